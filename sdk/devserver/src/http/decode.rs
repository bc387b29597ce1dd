//! Request bodies: size limit, strict JSON, typed decoding. The body is
//! judged as JSON whatever `Content-Type` says.
use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use serde::de::DeserializeOwned;
use serde_json::Value;
use toolrunner_protocol::ApiError;
use toolrunner_protocol::json::{JsonError, MAX_BODY_BYTES, parse_strict};

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

/// Parses bytes under the protocol's JSON rules.
pub(crate) fn parse(bytes: &[u8]) -> Result<Value, ApiError> {
    if bytes.is_empty() {
        return Err(ApiError::invalid(
            "invalid_json",
            "the request body is empty; send a JSON object",
        ));
    }
    parse_strict(bytes).map_err(|e| {
        let code = match e {
            JsonError::TooDeep => "too_deep",
            JsonError::DuplicateKey(_) => "duplicate_key",
            JsonError::IntegerOutOfRange(_) => "number_out_of_range",
            _ => "invalid_json",
        };
        ApiError::invalid(code, format!("the body is not acceptable JSON: {e}"))
    })
}

/// Decodes a JSON value into a request type; errors name the field.
pub(crate) fn decode<T: DeserializeOwned>(value: Value) -> Result<T, ApiError> {
    if !value.is_object() {
        return Err(ApiError::invalid(
            "invalid_type",
            "the body must be a JSON object",
        ));
    }
    serde_path_to_error::deserialize::<_, T>(value).map_err(|e| {
        let path = e.path().to_string();
        let message = e.inner().to_string();
        let named = message.split('`').nth(1).unwrap_or_default().to_owned();
        let join = |field: &str| match path.as_str() {
            "." | "" => field.to_owned(),
            p if p.ends_with(field) => p.to_owned(),
            p => format!("{p}.{field}"),
        };
        let (code, param) = if message.starts_with("unknown field") {
            ("unknown_field", join(&named))
        } else if message.starts_with("missing field") {
            ("missing_field", join(&named))
        } else if message.starts_with("unknown variant") && path.ends_with("state") {
            ("invalid_state", path.clone())
        } else {
            ("invalid_type", path.clone())
        };
        let err = ApiError::invalid(code, format!("{param}: {message}"));
        if param.is_empty() || param == "." {
            err
        } else {
            err.with_param(param)
        }
    })
}
