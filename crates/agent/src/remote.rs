//! Calling the remote service.

use std::time::Duration;

use sas_messages::StepRequest;

/// Header carrying the step's idempotency key on every call.
pub const IDEMPOTENCY_KEY_HEADER: &str = "Idempotency-Key";

/// What one call to the remote service told us.
#[derive(Debug, Clone, PartialEq)]
pub enum CallResult {
    /// Applied (or already applied under this key): the service's answer.
    Success(serde_json::Value),
    /// Refused for good (4xx): retrying cannot help.
    Permanent(String),
    /// Might work later (5xx, 408, 429, connection refused, timeout).
    Transient(String),
}

/// An HTTP client for one remote service.
#[derive(Debug, Clone)]
pub struct RemoteClient {
    http: reqwest::Client,
    base_url: String,
}

impl RemoteClient {
    /// A client for the service at `base_url`.
    ///
    /// # Errors
    /// When the HTTP client cannot be built.
    pub fn new(base_url: &str) -> anyhow::Result<Self> {
        let http = reqwest::Client::builder()
            .pool_idle_timeout(Duration::from_secs(30))
            .connect_timeout(Duration::from_secs(2))
            .build()?;
        Ok(Self {
            http,
            base_url: base_url.trim_end_matches('/').to_owned(),
        })
    }

    /// The service's base URL.
    pub fn base_url(&self) -> &str {
        &self.base_url
    }

    /// POSTs the request's payload to `<base_url>/<action>` with its
    /// idempotency key, waiting at most `timeout`.
    pub async fn call(&self, request: &StepRequest, timeout: Duration) -> CallResult {
        let url = format!("{}/{}", self.base_url, request.action);
        let sent = self
            .http
            .post(&url)
            .header(IDEMPOTENCY_KEY_HEADER, &request.idempotency_key)
            .timeout(timeout)
            .json(&request.payload)
            .send()
            .await;
        let response = match sent {
            Ok(response) => response,
            Err(error) if error.is_timeout() => {
                return CallResult::Transient(format!("no answer from {url} within {timeout:?}"))
            }
            Err(error) => return CallResult::Transient(format!("cannot call {url}: {error}")),
        };
        let status = response.status();
        let body = match response.bytes().await {
            Ok(body) => body,
            Err(error) => {
                return CallResult::Transient(format!("reading the answer of {url}: {error}"))
            }
        };
        if status.is_success() {
            return match serde_json::from_slice(&body) {
                Ok(value) => CallResult::Success(value),
                Err(_) => CallResult::Success(serde_json::Value::String(
                    String::from_utf8_lossy(&body).into_owned(),
                )),
            };
        }
        let text = String::from_utf8_lossy(&body);
        let message = format!(
            "{url} answered {status}: {}",
            text.chars().take(500).collect::<String>()
        );
        if status.is_client_error() && status.as_u16() != 408 && status.as_u16() != 429 {
            CallResult::Permanent(message)
        } else {
            CallResult::Transient(message)
        }
    }
}
