//! Query-string checks.
use std::collections::HashMap;

use toolrunner_protocol::ApiError;

/// `400 unknown_field` for a query parameter not in `allowed`.
pub(crate) fn only(q: &HashMap<String, String>, allowed: &[&str]) -> Result<(), ApiError> {
    match q.keys().find(|k| !allowed.contains(&k.as_str())) {
        Some(k) => Err(
            ApiError::invalid("unknown_field", format!("unknown query parameter {k}"))
                .with_param(k.clone()),
        ),
        None => Ok(()),
    }
}

/// A required query parameter.
pub(crate) fn required<'a>(
    q: &'a HashMap<String, String>,
    name: &str,
) -> Result<&'a str, ApiError> {
    q.get(name).map(String::as_str).ok_or_else(|| {
        ApiError::invalid(
            "missing_field",
            format!("the query parameter {name} is required"),
        )
        .with_param(name)
    })
}
