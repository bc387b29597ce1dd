//! A tool's own approval policy: which of its calls need a person's yes
//! (an amount over a threshold), asked after the product's authorizer
//! allowed the call ([`ExecutorBuilder::approval_policy`]).
//!
//! [`ExecutorBuilder::approval_policy`]: crate::ExecutorBuilder::approval_policy
use std::collections::HashMap;
use std::sync::Arc;

use async_trait::async_trait;

use super::approval::ApprovalRequest;
use super::authorizer::{AuthorizationRequest, Authorizer, Denied};

/// Which calls of one tool need a person's yes. Asked for each call of the
/// tool that the executor's [`Authorizer`] did not refuse (allowed, or
/// sent to a person), with the same request (arguments checked against
/// the schema and the digest). A refusal of the policy refuses the call
/// even when the authorizer asked a person; a call both send to a person
/// waits for one request, with the authorizer's reason.
///
/// ```
/// use std::time::Duration;
/// use toolrunner::{AuthorizationRequest, Denied, Executor};
///
/// let builder = Executor::builder().approval_policy(
///     "refunds.refund",
///     |request: &AuthorizationRequest| match request.arguments["amount"].as_u64() {
///         Some(amount) if amount > 100_000 => Err(Denied::needs_approval(
///             format!("a refund of {amount} cents is over 1,000"),
///             Duration::from_secs(3600),
///         )),
///         _ => Ok(()),
///     },
/// );
/// # let _ = builder;
/// ```
pub trait ApprovalPolicy: Send + Sync + 'static {
    /// `Ok(())` lets the call run; `Err(Denied::needs_approval(reason,
    /// expiry))` asks a person first (as the authorizer's answer does);
    /// `Err(Denied::new(message))` refuses it.
    ///
    /// # Errors
    /// The call needs a person's yes, or is refused.
    fn check(&self, request: &AuthorizationRequest) -> Result<(), Denied>;
}

impl<F> ApprovalPolicy for F
where
    F: Fn(&AuthorizationRequest) -> Result<(), Denied> + Send + Sync + 'static,
{
    fn check(&self, request: &AuthorizationRequest) -> Result<(), Denied> {
        self(request)
    }
}

/// The product's authorizer, then the called tool's policy (if it has
/// one): what the executor asks before a call runs.
pub(crate) struct WithPolicies {
    pub(crate) authorizer: Arc<dyn Authorizer>,
    pub(crate) policies: HashMap<String, Arc<dyn ApprovalPolicy>>,
}

#[async_trait]
impl Authorizer for WithPolicies {
    async fn authorize(&self, request: &AuthorizationRequest) -> Result<(), Denied> {
        let authorized = self.authorizer.authorize(request).await;
        // A refusal of the authorizer stands; the tool's policy is asked
        // otherwise, also when the authorizer asks a person (a call its
        // tool refuses is never shown to an approver).
        if let Err(d) = &authorized
            && d.approval.is_none()
        {
            return authorized;
        }
        let policy = match self.policies.get(&request.tool_name) {
            Some(policy) => policy.check(request),
            None => Ok(()),
        };
        match (authorized, policy) {
            (_, Err(refused)) if refused.approval.is_none() => Err(refused),
            (Err(asked), _) | (Ok(()), Err(asked)) => Err(asked),
            (Ok(()), Ok(())) => Ok(()),
        }
    }

    async fn on_approval_requested(&self, request: &ApprovalRequest) {
        self.authorizer.on_approval_requested(request).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::authorizer::AllowAll;

    fn request(tool: &str, amount: u64) -> AuthorizationRequest {
        AuthorizationRequest {
            subject: "user_1".into(),
            agent_id: "agt".into(),
            agent_version: "1".into(),
            tool_name: tool.into(),
            arguments: serde_json::json!({"amount": amount}),
            arguments_digest: "d".into(),
            run_id: "run".into(),
            call_id: "call".into(),
        }
    }

    struct RefuseAll;

    #[async_trait]
    impl Authorizer for RefuseAll {
        async fn authorize(&self, _request: &AuthorizationRequest) -> Result<(), Denied> {
            Err(Denied::new("no"))
        }
    }

    struct AsksAPerson;

    #[async_trait]
    impl Authorizer for AsksAPerson {
        async fn authorize(&self, _request: &AuthorizationRequest) -> Result<(), Denied> {
            Err(Denied::needs_approval(
                "a person",
                std::time::Duration::from_secs(30),
            ))
        }
    }

    fn refuse_over(limit: u64) -> Arc<dyn ApprovalPolicy> {
        Arc::new(move |r: &AuthorizationRequest| {
            if r.arguments["amount"].as_u64().unwrap_or(0) > limit {
                Err(Denied::new("too much"))
            } else {
                Ok(())
            }
        })
    }

    fn over(limit: u64) -> Arc<dyn ApprovalPolicy> {
        Arc::new(move |r: &AuthorizationRequest| {
            if r.arguments["amount"].as_u64().unwrap_or(0) > limit {
                Err(Denied::needs_approval(
                    "over",
                    std::time::Duration::from_secs(60),
                ))
            } else {
                Ok(())
            }
        })
    }

    #[tokio::test]
    async fn the_policy_asks_only_for_its_tool_and_after_the_authorizer() {
        let allowed = WithPolicies {
            authorizer: Arc::new(AllowAll),
            policies: HashMap::from([("refund".to_owned(), over(100))]),
        };
        assert_eq!(allowed.authorize(&request("refund", 50)).await, Ok(()));
        let asked = allowed.authorize(&request("refund", 500)).await;
        assert_eq!(
            asked.as_ref().map_err(Denied::approval_window),
            Err(Some(std::time::Duration::from_secs(60)))
        );
        // The authorizer asks a person, and the policy refuses outright:
        // refused (an approver never sees a call its tool refuses).
        let asks = WithPolicies {
            authorizer: Arc::new(AsksAPerson),
            policies: HashMap::from([("refund".to_owned(), refuse_over(100))]),
        };
        assert_eq!(
            asks.authorize(&request("refund", 500)).await,
            Err(Denied::new("too much"))
        );
        let asked = asks.authorize(&request("refund", 50)).await;
        assert_eq!(
            asked.as_ref().map_err(Denied::approval_window),
            Err(Some(std::time::Duration::from_secs(30)))
        );
        // Another tool: the policy is not asked.
        assert_eq!(allowed.authorize(&request("charge", 500)).await, Ok(()));
        // The authorizer refuses first: no approval is asked.
        let refused = WithPolicies {
            authorizer: Arc::new(RefuseAll),
            policies: HashMap::from([("refund".to_owned(), over(100))]),
        };
        assert_eq!(
            refused.authorize(&request("refund", 500)).await,
            Err(Denied::new("no"))
        );
    }
}
