//! The error envelope every 4xx and 5xx answer carries.
//!
//! This is a *wire* type: what the platform says went wrong. It is kept apart
//! from the Rust error types of the crates that use it.
use serde::{Deserialize, Serialize};

/// The `type` of an error envelope.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum ErrorType {
    /// `400`: malformed body, failed validation, unknown call in a known run.
    InvalidRequestError,
    /// `400`: a tool/toolset combination the platform cannot run.
    UnsupportedOrInvalidConfiguration,
    /// `401`: no or bad token.
    AuthenticationError,
    /// `403`: missing scope, wrong executor or tool, invalid grant.
    PermissionError,
    /// `404`: unknown resource named in the path.
    NotFoundError,
    /// `409`: state conflicts.
    ConflictError,
    /// `429`: slow down, see `Retry-After`.
    RateLimitError,
    /// `5xx`: retry with backoff.
    ApiError,
}

impl ErrorType {
    /// The wire spelling, e.g. `conflict_error`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::InvalidRequestError => "invalid_request_error",
            Self::UnsupportedOrInvalidConfiguration => "unsupported_or_invalid_configuration",
            Self::AuthenticationError => "authentication_error",
            Self::PermissionError => "permission_error",
            Self::NotFoundError => "not_found_error",
            Self::ConflictError => "conflict_error",
            Self::RateLimitError => "rate_limit_error",
            Self::ApiError => "api_error",
        }
    }
}

/// The body inside `{"error": …}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// The error type.
    #[serde(rename = "type")]
    pub kind: ErrorType,
    /// Machine-readable code, e.g. `receipt_conflict`.
    pub code: String,
    /// A sentence for a human.
    pub message: String,
    /// The request parameter at fault, if any.
    pub param: Option<String>,
}

/// `{"error": {...}}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorEnvelope {
    /// The error.
    pub error: ErrorBody,
}

/// An error answer: HTTP status plus envelope body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// HTTP status code.
    pub status: u16,
    /// The envelope body.
    pub body: ErrorBody,
}

impl ApiError {
    /// An error with `status`, `kind`, `code` and `message`, no `param`.
    pub fn new(status: u16, kind: ErrorType, code: &str, message: impl Into<String>) -> Self {
        Self {
            status,
            body: ErrorBody {
                kind,
                code: code.to_owned(),
                message: message.into(),
                param: None,
            },
        }
    }

    /// The same error naming `param`.
    #[must_use]
    pub fn with_param(mut self, param: impl Into<String>) -> Self {
        self.body.param = Some(param.into());
        self
    }

    /// The same error naming `param` if there is one.
    #[must_use]
    pub fn with_param_opt(mut self, param: Option<String>) -> Self {
        self.body.param = param;
        self
    }

    /// `400 invalid_request_error`.
    pub fn invalid(code: &str, message: impl Into<String>) -> Self {
        Self::new(400, ErrorType::InvalidRequestError, code, message)
    }

    /// `400 unsupported_or_invalid_configuration`.
    pub fn unsupported(code: &str, message: impl Into<String>) -> Self {
        Self::new(
            400,
            ErrorType::UnsupportedOrInvalidConfiguration,
            code,
            message,
        )
    }

    /// `401 authentication_error`.
    pub fn unauthenticated(code: &str, message: impl Into<String>) -> Self {
        Self::new(401, ErrorType::AuthenticationError, code, message)
    }

    /// `403 permission_error`.
    pub fn forbidden(code: &str, message: impl Into<String>) -> Self {
        Self::new(403, ErrorType::PermissionError, code, message)
    }

    /// `404 not_found_error`.
    pub fn not_found(code: &str, message: impl Into<String>) -> Self {
        Self::new(404, ErrorType::NotFoundError, code, message)
    }

    /// `409 conflict_error`.
    pub fn conflict(code: &str, message: impl Into<String>) -> Self {
        Self::new(409, ErrorType::ConflictError, code, message)
    }

    /// The envelope to put on the wire.
    pub fn envelope(&self) -> ErrorEnvelope {
        ErrorEnvelope {
            error: self.body.clone(),
        }
    }

    /// The machine-readable code.
    pub fn code(&self) -> &str {
        &self.body.code
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {} ({}): {}",
            self.status,
            self.body.kind.as_str(),
            self.body.code,
            self.body.message
        )
    }
}

impl std::error::Error for ApiError {}
