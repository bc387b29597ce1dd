//! The driver's side of the machine's inputs: the client's results as the
//! machine's [`Reply`], and the store's and the client's failures as a
//! [`Pause`].
use super::machine::{Pause, Reply};
use crate::net::client::ClientError;
use crate::store::StoreError;

/// The client's result for a request, as the machine reads it.
pub(crate) fn reply<T>(result: &Result<T, ClientError>) -> Reply<&T> {
    match result {
        Ok(answer) => Reply::Answered(answer),
        Err(ClientError::NotReady(_)) => Reply::NotSent,
        Err(ClientError::Unreachable(m)) => Reply::Unreachable(m.clone()),
        Err(e @ ClientError::Api(api)) => Reply::Refused {
            status: api.status,
            code: api.code().to_owned(),
            message: e.to_string(),
        },
    }
}

impl From<StoreError> for Pause {
    fn from(e: StoreError) -> Pause {
        Pause::Waits(e.to_string())
    }
}

impl From<ClientError> for Pause {
    /// A request that did not go out for a lapsed lease is that pause;
    /// any other failure waits with its message.
    fn from(e: ClientError) -> Pause {
        match e {
            ClientError::NotReady(_) => Pause::LeaseNotLive,
            ClientError::Unreachable(m) => Pause::Waits(m),
            e => Pause::Waits(e.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_not_sent_for_a_lapsed_lease_is_that_pause() {
        let not_sent = ClientError::NotReady("POST /v1/runs/r/tool-calls/c/claim".into());
        assert_eq!(reply::<()>(&Err(not_sent.clone())), Reply::NotSent);
        assert_eq!(Pause::from(not_sent), Pause::LeaseNotLive);
        let down = ClientError::Unreachable("connection refused".into());
        assert_eq!(
            reply::<()>(&Err(down.clone())),
            Reply::Unreachable("connection refused".into())
        );
        assert_eq!(Pause::from(down), Pause::waits("connection refused"));
    }
}
