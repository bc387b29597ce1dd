//! The SDK's one error type.
use std::sync::Arc;

use toolrunner_protocol::ApiError;

/// What went wrong. Ask with the `is_*` methods; the message says what was
/// wrong and what to do; [`status`](Error::status) and
/// [`code`](Error::code) carry the platform's answer when there was one,
/// and [`source`](std::error::Error::source) the cause.
#[derive(Clone)]
pub struct Error {
    kind: Kind,
    message: String,
    status: Option<u16>,
    code: Option<String>,
    source: Option<Arc<dyn std::error::Error + Send + Sync>>,
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
    MissingFeature,
}

impl Error {
    pub(crate) fn new(kind: Kind, message: impl Into<String>) -> Error {
        Error {
            kind,
            message: message.into(),
            status: None,
            code: None,
            source: None,
        }
    }

    /// The same error, its message prefixed with what was being done.
    pub(crate) fn context(mut self, doing: &str) -> Error {
        self.message = format!("{doing}: {}", self.message);
        self
    }

    /// The same error, carrying the platform's answer (status, code,
    /// source).
    pub(crate) fn with_api(mut self, api: ApiError) -> Error {
        self.status = Some(api.status);
        self.code = Some(api.code().to_owned());
        self.with_source(api)
    }

    pub(crate) fn with_source(
        mut self,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Error {
        self.source = Some(Arc::new(source));
        self
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

    /// The local store failed (or another process holds it).
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

    /// What was asked needs a cargo feature this build of the SDK lacks
    /// (a `postgres://` store without the `postgres` feature): turn the
    /// feature on in your `Cargo.toml`.
    pub fn is_missing_feature(&self) -> bool {
        self.kind == Kind::MissingFeature
    }

    /// The platform could not be reached after retries.
    pub fn is_unreachable(&self) -> bool {
        self.kind == Kind::Unreachable
    }

    /// The platform's HTTP status, when the platform answered.
    pub fn status(&self) -> Option<u16> {
        self.status
    }

    /// The platform's error code (`invalid_grant`, `missing_scope`, …), when
    /// the platform answered.
    pub fn code(&self) -> Option<&str> {
        self.code.as_deref()
    }
}

/// A sentence, as `main` returning the error prints it: the message, then
/// each cause the message does not already quote (`anyhow`'s layout).
impl std::fmt::Debug for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)?;
        let mut causes = Vec::new();
        let mut next = std::error::Error::source(self);
        while let Some(cause) = next {
            let text = cause.to_string();
            if !self.message.contains(&text) && !causes.contains(&text) {
                causes.push(text);
            }
            next = cause.source();
        }
        if !causes.is_empty() {
            f.write_str("\n\nCaused by:")?;
            for (i, cause) in causes.iter().enumerate() {
                write!(f, "\n    {i}: {cause}")?;
            }
        }
        Ok(())
    }
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

/// The error of a refusal the platform answered: a refused token or a
/// missing scope is a configuration to fix, anything else the platform's.
pub(crate) fn from_api(api: ApiError) -> Error {
    let (kind, message) = if api.status == 401 {
        (
            Kind::Configuration,
            format!(
                "the platform refused the executor's token ({api}): check TOOLRUNNER_TOKEN (or .token(..))"
            ),
        )
    } else if api.code() == "missing_scope" {
        (
            Kind::Configuration,
            format!(
                "the executor's token lacks a scope ({api}): give it executors:connect and tools:execute"
            ),
        )
    } else {
        (Kind::Platform, api.to_string())
    };
    Error::new(kind, message).with_api(api)
}

/// This release's `MAJOR.MINOR`, as a product's `Cargo.toml` names it.
const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION_MAJOR"),
    ".",
    env!("CARGO_PKG_VERSION_MINOR")
);

/// The error for `what`, which needs the cargo feature `feature`.
#[cfg_attr(feature = "postgres", allow(dead_code))]
pub(crate) fn missing_feature(what: &str, feature: &str) -> Error {
    Error::new(
        Kind::MissingFeature,
        format!(
            "{what} needs the `{feature}` feature of toolrunner: toolrunner = {{ version = \"{VERSION}\", features = [\"{feature}\"] }}"
        ),
    )
}

/// A `Result` with the SDK's error.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Completes on Ctrl-C, or on `SIGTERM` where there is one: the signal a
/// container or a service manager sends to stop a process. For
/// [`Executor::serve`](crate::Executor::serve).
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_feature_is_its_own_kind_and_says_what_to_turn_on() {
        let e = missing_feature("a postgres:// store", "postgres");
        assert!(e.is_missing_feature());
        assert!(!e.is_configuration() && !e.is_builder() && !e.is_store());
        assert_eq!(
            e.to_string(),
            format!(
                "a postgres:// store needs the `postgres` feature of toolrunner: toolrunner = {{ version = \"{}\", features = [\"postgres\"] }}",
                VERSION
            )
        );
        // `0.1` of `0.1.0`: what a product's Cargo.toml writes.
        assert!(env!("CARGO_PKG_VERSION").starts_with(&format!("{VERSION}.")));
        assert_eq!(VERSION.matches('.').count(), 1);
    }
}
