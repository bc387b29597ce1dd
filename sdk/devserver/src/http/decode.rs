//! Request bodies: size limit, strict JSON, typed decoding. The body is
//! judged as JSON whatever `Content-Type` says.
use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use serde::de::DeserializeOwned;
use serde_json::Value;
use toolrunner_protocol::ApiError;
use toolrunner_protocol::json::MAX_BODY_BYTES;

/// A request body read up to the 4 MiB limit. It never rejects, so that the
/// handler can check authentication and scopes first.
pub(crate) struct Body(pub(crate) Result<Bytes, ApiError>);

fn too_large() -> ApiError {
    ApiError::new(
        413,
        toolrunner_protocol::ErrorType::InvalidRequestError,
        "payload_too_large",
        format!("request bodies are limited to {MAX_BODY_BYTES} bytes"),
    )
}

/// Beyond this much, an oversized body is no longer read to its end: the
/// connection is closed instead.
const DRAIN_LIMIT: usize = 64 * 1024 * 1024;

impl<S: Send + Sync> FromRequest<S> for Body {
    type Rejection = std::convert::Infallible;

    async fn from_request(req: Request, _state: &S) -> Result<Self, Self::Rejection> {
        use futures_util::StreamExt;
        let mut stream = req.into_body().into_data_stream();
        let mut kept = Vec::new();
        let mut seen = 0usize;
        while let Some(chunk) = stream.next().await {
            let Ok(chunk) = chunk else {
                return Ok(Body(Err(ApiError::invalid(
                    "invalid_body",
                    "the request body could not be read",
                ))));
            };
            seen += chunk.len();
            if seen <= MAX_BODY_BYTES {
                kept.extend_from_slice(&chunk);
            } else if seen > DRAIN_LIMIT {
                break;
            }
        }
        // An oversized body is read to its end (up to a limit) so that the
        // client gets the 413 instead of a reset connection.
        if seen > MAX_BODY_BYTES {
            return Ok(Body(Err(too_large())));
        }
        Ok(Body(Ok(Bytes::from(kept))))
    }
}

impl Body {
    /// The raw bytes, or the reading error.
    pub(crate) fn bytes(&self) -> Result<&Bytes, ApiError> {
        self.0.as_ref().map_err(Clone::clone)
    }

    /// The body as strict JSON.
    pub(crate) fn value(&self) -> Result<Value, ApiError> {
        parse(self.bytes()?)
    }

    /// The body decoded into `T`.
    pub(crate) fn json<T: DeserializeOwned>(&self) -> Result<T, ApiError> {
        decode(self.value()?)
    }
}

pub(crate) use crate::engine::json::{decode, parse};
