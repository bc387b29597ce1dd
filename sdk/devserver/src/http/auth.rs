//! Bearer tokens and their scopes.
use std::collections::HashMap;
use std::sync::Arc;

use axum::extract::FromRequestParts;
use axum::http::header::AUTHORIZATION;
use axum::http::request::Parts;
use toolrunner_protocol::ApiError;

/// A permission a token may carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Scope {
    /// `executors:connect`.
    ExecutorsConnect,
    /// `tools:execute`.
    ToolsExecute,
    /// `runtime:read`.
    RuntimeRead,
    /// `configuration:read`.
    ConfigurationRead,
    /// `configuration:write`.
    ConfigurationWrite,
    /// `runs:write`.
    RunsWrite,
}

impl Scope {
    /// Parses a scope's wire name.
    pub fn parse(name: &str) -> Option<Scope> {
        Some(match name {
            "executors:connect" => Scope::ExecutorsConnect,
            "tools:execute" => Scope::ToolsExecute,
            "runtime:read" => Scope::RuntimeRead,
            "configuration:read" => Scope::ConfigurationRead,
            "configuration:write" => Scope::ConfigurationWrite,
            "runs:write" => Scope::RunsWrite,
            _ => return None,
        })
    }

    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            Scope::ExecutorsConnect => "executors:connect",
            Scope::ToolsExecute => "tools:execute",
            Scope::RuntimeRead => "runtime:read",
            Scope::ConfigurationRead => "configuration:read",
            Scope::ConfigurationWrite => "configuration:write",
            Scope::RunsWrite => "runs:write",
        }
    }
}

/// What one token may do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Grants {
    /// `*`.
    All,
    /// A list.
    Some(Vec<Scope>),
}

/// The token table.
pub(crate) type Tokens = Arc<HashMap<String, Grants>>;

/// The scopes of the request's bearer token.
pub(crate) struct Auth(Grants);

impl Auth {
    /// `403 missing_scope` unless the token has one of `any`.
    pub(crate) fn require(&self, any: &[Scope]) -> Result<(), ApiError> {
        match &self.0 {
            Grants::All => Ok(()),
            Grants::Some(have) if any.iter().any(|s| have.contains(s)) => Ok(()),
            Grants::Some(_) => {
                let names: Vec<&str> = any.iter().map(|s| s.as_str()).collect();
                Err(ApiError::forbidden(
                    "missing_scope",
                    format!("this token lacks the scope {}", names.join(" or ")),
                ))
            }
        }
    }

    /// `403 missing_scope` unless the token was given `*`.
    pub(crate) fn require_all(&self) -> Result<(), ApiError> {
        match self.0 {
            Grants::All => Ok(()),
            Grants::Some(_) => Err(ApiError::forbidden(
                "missing_scope",
                "this endpoint needs a token given *",
            )),
        }
    }
}

/// Something that holds the token table.
pub(crate) trait HasTokens {
    fn tokens(&self) -> &Tokens;
}

impl<S: HasTokens + Send + Sync> FromRequestParts<S> for Auth {
    type Rejection = super::respond::Failure;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        let header = parts
            .headers
            .get(AUTHORIZATION)
            .and_then(|v| v.to_str().ok());
        let token = header.and_then(|h| {
            let (scheme, token) = h.split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then_some(token)
        });
        let Some(token) = token else {
            return Err(ApiError::unauthenticated(
                "missing_token",
                "send Authorization: Bearer <token>",
            )
            .into());
        };
        match state.tokens().get(token.trim()) {
            Some(grants) => Ok(Auth(grants.clone())),
            None => Err(ApiError::unauthenticated(
                "invalid_token",
                "the bearer token is not known",
            )
            .into()),
        }
    }
}

/// Parses `TOKEN=SCOPES` (`*` or comma-separated scope names).
pub(crate) fn parse_token_spec(spec: &str) -> Result<(String, Grants), String> {
    let (token, scopes) = spec
        .rsplit_once('=')
        .ok_or_else(|| format!("token spec {spec:?} must look like TOKEN=SCOPES"))?;
    if token.is_empty() {
        return Err("a token must not be empty".to_owned());
    }
    if scopes.trim() == "*" {
        return Ok((token.to_owned(), Grants::All));
    }
    let list = scopes
        .split(',')
        .map(|s| {
            Scope::parse(s.trim()).ok_or_else(|| format!("unknown scope {s:?} for token {token:?}"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok((token.to_owned(), Grants::Some(list)))
}
