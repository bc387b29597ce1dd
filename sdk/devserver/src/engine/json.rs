//! Bodies as the protocol judges them, free of HTTP: strict JSON (the
//! protocol's rules) and typed decoding whose errors name the field.
use serde::de::DeserializeOwned;
use serde_json::Value;
use toolrunner_protocol::ApiError;
use toolrunner_protocol::json::{JsonError, parse_strict};

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
