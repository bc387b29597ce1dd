//! The SDK's one error type.
use toolrunner_protocol::ApiError;

/// What went wrong. Ask with the `is_*` methods; the message says what to do.
pub struct Error {
    kind: Kind,
    message: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Builder,
    Configuration,
    Superseded,
    Store,
    Platform,
    Unreachable,
    Refused,
}

impl Error {
    pub(crate) fn new(kind: Kind, message: impl Into<String>) -> Error {
        Error {
            kind,
            message: message.into(),
        }
    }

    /// A builder setting is missing or invalid (found at `build()`).
    pub fn is_builder(&self) -> bool {
        self.kind == Kind::Builder
    }

    /// The platform refused the credentials (`401`, `403 missing_scope`):
    /// the executor stopped claiming and kept everything it had.
    pub fn is_configuration(&self) -> bool {
        self.kind == Kind::Configuration
    }

    /// Another process connected with the same executor id (two live
    /// processes share one id): this one stopped claiming.
    pub fn is_superseded(&self) -> bool {
        self.kind == Kind::Superseded
    }

    /// The local store failed.
    pub fn is_store(&self) -> bool {
        self.kind == Kind::Store
    }

    /// The platform answered an error the executor cannot act on.
    pub fn is_platform(&self) -> bool {
        self.kind == Kind::Platform
    }

    /// An operator request was refused (wrong state, bad evidence, unknown
    /// call); nothing changed.
    pub fn is_refused(&self) -> bool {
        self.kind == Kind::Refused
    }

    /// The platform could not be reached after retries.
    pub fn is_unreachable(&self) -> bool {
        self.kind == Kind::Unreachable
    }
}

impl std::fmt::Debug for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Error")
            .field("kind", &self.kind)
            .field("message", &self.message)
            .finish()
    }
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Error {}

impl From<crate::store::StoreError> for Error {
    fn from(e: crate::store::StoreError) -> Self {
        Error::new(Kind::Store, e.to_string())
    }
}

impl From<crate::client::ClientError> for Error {
    fn from(e: crate::client::ClientError) -> Self {
        match e {
            crate::client::ClientError::Api(api) => from_api(&api),
            crate::client::ClientError::Unreachable(m) => Error::new(Kind::Unreachable, m),
        }
    }
}

fn from_api(api: &ApiError) -> Error {
    if api.status == 401 || api.code() == "missing_scope" {
        return Error::new(
            Kind::Configuration,
            format!(
                "the platform refused the executor's token ({api}); check TOOLRUNNER_TOKEN and its scopes (executors:connect, tools:execute)"
            ),
        );
    }
    Error::new(Kind::Platform, api.to_string())
}

/// A `Result` with the SDK's error.
pub type Result<T, E = Error> = std::result::Result<T, E>;
