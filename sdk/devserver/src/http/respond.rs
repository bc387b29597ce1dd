//! Turning answers and errors into HTTP responses.
use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use toolrunner_protocol::ApiError;

/// An error answer with the envelope.
pub(crate) struct Failure(pub(crate) ApiError);

impl From<ApiError> for Failure {
    fn from(e: ApiError) -> Self {
        Failure(e)
    }
}

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        let status =
            StatusCode::from_u16(self.0.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        (status, Json(self.0.envelope())).into_response()
    }
}

/// What handlers return.
pub(crate) type Answer<T> = Result<Json<T>, Failure>;

/// Wraps a successful operation's value.
pub(crate) fn ok<T: Serialize>(value: Result<T, ApiError>) -> Answer<T> {
    value.map(Json).map_err(Failure)
}
