//! Failures of a request, answered as an HTML page or as JSON depending on
//! where it was asked (`/api/...` gets JSON), with a message that says what
//! went wrong and what to do.

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use sas_store::reads::search::FilterError;
use sas_store::StoreError;

/// A failed request: its status and what to tell the caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// HTTP status.
    pub status: StatusCode,
    /// What went wrong and what to do.
    pub message: String,
}

impl Failure {
    /// A failure with `status` and `message`.
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }

    /// 404 naming what is missing.
    pub fn not_found(what: impl std::fmt::Display) -> Self {
        Self::new(StatusCode::NOT_FOUND, format!("no {what}"))
    }

    /// 409: the thing is not in a state that allows the action.
    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, message)
    }

    /// 400: bad input.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }
}

impl From<FilterError> for Failure {
    fn from(error: FilterError) -> Self {
        Self::bad_request(error.to_string())
    }
}

impl From<StoreError> for Failure {
    fn from(error: StoreError) -> Self {
        tracing::error!(error = %error, "state store request failed");
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("the state store could not answer ({error}); try again, and check /readyz if it persists"),
        )
    }
}

/// A failure answered as JSON: `{"error": "..."}`.
#[derive(Debug)]
pub struct ApiFailure(pub Failure);

impl<T: Into<Failure>> From<T> for ApiFailure {
    fn from(failure: T) -> Self {
        Self(failure.into())
    }
}

impl IntoResponse for ApiFailure {
    fn into_response(self) -> Response {
        (
            self.0.status,
            axum::Json(serde_json::json!({ "error": self.0.message })),
        )
            .into_response()
    }
}

/// A failure answered as a small HTML page.
#[derive(Debug)]
pub struct PageFailure(pub Failure);

impl<T: Into<Failure>> From<T> for PageFailure {
    fn from(failure: T) -> Self {
        Self(failure.into())
    }
}

impl IntoResponse for PageFailure {
    fn into_response(self) -> Response {
        let title = self.0.status.canonical_reason().unwrap_or("error");
        let page = maud::html! {
            (maud::DOCTYPE)
            html lang="en" {
                head { meta charset="utf-8"; title { (title) " - sas console" } link rel="stylesheet" href="/static/console.css"; }
                body { main {
                    h1 { (self.0.status.as_u16()) " " (title) }
                    p.error { (self.0.message) }
                    p { a href="/" { "Overview" } " · " a href="javascript:history.back()" { "Back" } }
                } }
            }
        };
        (
            self.0.status,
            [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
            page.into_string(),
        )
            .into_response()
    }
}
