//! Calling the remote service, and how its answers are classified.
//!
//! Every answer falls in one of five classes ([`CallResult`]); docs/configuration.md's
//! "Remote answers" table is the same mapping:
//!
//! | answer | class |
//! |---|---|
//! | 2xx with a JSON body (at most `agent.max_answer_bytes`) | succeeded |
//! | 404 to a compensation | succeeded: nothing to undo |
//! | any other 4xx but 408, 409, 425, 429 | refused: nothing applied |
//! | connect error (refused, DNS, TLS handshake, certificate), 408, 425, 429 | transient: nothing applied |
//! | 409 | in progress: retry the same key later |
//! | timeout or reset after sending, any 5xx, 1xx/3xx, a 2xx whose body is not JSON, too large or cut | outcome unknown: may have been applied |
//!
//! A 503 too: a gateway can answer it after the service behind it took the
//! request, so it is never read as "nothing applied".
//!
//! reqwest tells a connect error (nothing was sent: the TCP connection or
//! the TLS handshake failed) apart from one after the request went out; only
//! the first is safe to call "not applied".

use std::time::Duration;

use sas_messages::storable::{make_storable, REPLACEMENT};
use sas_messages::{StepKind, StepRequest};
use tracing::Instrument as _;

use crate::settings::AgentSettings;

/// Header carrying the step's idempotency key on every call.
pub const IDEMPOTENCY_KEY_HEADER: &str = "Idempotency-Key";

/// Longest error text carried in a reply, in characters.
pub const MAX_ERROR_CHARS: usize = 500;

/// What one call to the remote service told us.
#[derive(Debug, Clone, PartialEq)]
pub enum CallResult {
    /// Applied (or already applied under this key): the service's answer.
    Succeeded(serde_json::Value),
    /// Refused for good: nothing applied, and retrying cannot help.
    Refused(String),
    /// The call did not reach the service (or it said nothing was applied
    /// and to come back later): retry.
    Transient {
        /// What happened.
        error: String,
        /// The server's TLS certificate was not accepted.
        certificate: bool,
    },
    /// The service is applying this key right now (409): retry the same key later.
    InProgress(String),
    /// The call may have been applied: a timeout or reset after sending, a
    /// 5xx, an unusable 2xx answer.
    Unknown {
        /// What happened.
        error: String,
        /// The service failed (timeout, reset, 5xx), as opposed to having
        /// answered something we cannot use: counts against the circuit.
        service_failed: bool,
    },
}

impl CallResult {
    /// The class name, for logs and metrics.
    pub fn class(&self) -> &'static str {
        match self {
            Self::Succeeded(_) => "succeeded",
            Self::Refused(_) => "refused",
            Self::Transient { .. } => "transient",
            Self::InProgress(_) => "in_progress",
            Self::Unknown { .. } => "unknown",
        }
    }
}

/// The body of an answer, as far as it was read.
#[derive(Debug, Clone, PartialEq)]
pub enum Body {
    /// Read whole, within the limit.
    Complete(Vec<u8>),
    /// Longer than the limit (read up to it, or announced by Content-Length).
    TooLarge,
    /// Reading failed midway.
    Cut(String),
}

/// An HTTP client for one remote service.
#[derive(Debug, Clone)]
pub struct RemoteClient {
    http: reqwest::Client,
    base_url: String,
    auth: Option<reqwest::header::HeaderValue>,
    max_answer_bytes: usize,
    agent: String,
}

impl RemoteClient {
    /// A client of agent `agent` for the service at `base_url`, with the TLS
    /// roots, client identity and credentials of `settings`.
    ///
    /// # Errors
    /// When a TLS file or the credentials are unusable, or the HTTP client
    /// cannot be built.
    pub fn new(agent: &str, base_url: &str, settings: &AgentSettings) -> anyhow::Result<Self> {
        let tls = settings.tls_files().map_err(anyhow::Error::msg)?;
        sas_runtime::install_crypto_provider();
        let mut builder = reqwest::Client::builder()
            // rustls with the platform's verifier (the system's roots),
            // merged with the CA file's roots below.
            .tls_backend_rustls()
            // A redirect after a POST may mean "applied, see there": never
            // follow one blindly.
            .redirect(reqwest::redirect::Policy::none())
            .pool_idle_timeout(Duration::from_secs(30))
            .connect_timeout(Duration::from_secs(2));
        builder = builder.tls_certs_merge(tls.roots);
        if let Some(identity) = tls.identity {
            builder = builder.identity(identity);
        }
        let auth = if settings.remote_auth_header.is_empty() {
            None
        } else {
            let mut value =
                reqwest::header::HeaderValue::from_str(settings.remote_auth_header.expose())
                    .map_err(|_| {
                        anyhow::anyhow!("agent.remote_auth_header is not a header value")
                    })?;
            value.set_sensitive(true);
            Some(value)
        };
        Ok(Self {
            http: builder.build()?,
            base_url: base_url.trim_end_matches('/').to_owned(),
            auth,
            max_answer_bytes: settings.max_answer_bytes,
            agent: agent.to_owned(),
        })
    }

    /// The service's base URL.
    pub fn base_url(&self) -> &str {
        &self.base_url
    }

    /// POSTs the request's payload to `<base_url>/<action>` with its
    /// idempotency key and the order's trace context (`traceparent`: a
    /// child of the current span when spans are exported, else of the
    /// order's trace `trace_id`), waiting at most `timeout`. The action
    /// must have been checked with [`is_operation_name`].
    pub async fn call(
        &self,
        request: &StepRequest,
        timeout: Duration,
        trace_id: Option<&str>,
    ) -> CallResult {
        let url = format!("{}/{}", self.base_url, request.action);
        let span =
            tracing::info_span!("call", url = %url, idempotency_key = %request.idempotency_key);
        let traceparent = span
            .in_scope(sas_runtime::telemetry::current_traceparent)
            .or_else(|| trace_id.map(|id| sas_messages::TraceParent::child_of(id).to_string()));
        let mut builder = self
            .http
            .post(&url)
            .header(IDEMPOTENCY_KEY_HEADER, &request.idempotency_key)
            .timeout(timeout)
            .json(&request.payload);
        if let Some(traceparent) = traceparent {
            builder = builder.header(sas_messages::headers::TRACEPARENT, traceparent);
        }
        if let Some(auth) = &self.auth {
            builder = builder.header(reqwest::header::AUTHORIZATION, auth.clone());
        }
        let mut response = match builder.send().instrument(span).await {
            Ok(response) => response,
            Err(error) => return self.transport_error(&url, &error, timeout),
        };
        let status = response.status().as_u16();
        let body = read_bounded(&mut response, self.max_answer_bytes).await;
        classify(&url, status, request.kind, body, self.max_answer_bytes)
    }

    fn transport_error(&self, url: &str, error: &reqwest::Error, timeout: Duration) -> CallResult {
        let chain = error_chain(error);
        if error.is_connect() || error.is_builder() {
            // Connect errors (TCP, DNS, the TLS handshake) happen before a
            // byte of the request is sent.
            let certificate = chain.to_ascii_lowercase().contains("certificate");
            if certificate {
                metrics::counter!("sas_agent_certificate_failures_total", "agent" => self.agent.clone())
                    .increment(1);
                return CallResult::Transient {
                    error: bounded_text(&format!(
                        "cannot call {url}: its TLS certificate was not accepted (nothing sent): {chain}"
                    )),
                    certificate: true,
                };
            }
            return CallResult::Transient {
                error: bounded_text(&format!("cannot call {url} (nothing sent): {chain}")),
                certificate: false,
            };
        }
        let error = if error.is_timeout() {
            format!("no answer from {url} within {timeout:?}; it may have been applied")
        } else {
            format!("the call to {url} failed after it was sent; it may have been applied: {chain}")
        };
        CallResult::Unknown {
            error: bounded_text(&error),
            service_failed: true,
        }
    }
}

/// Whether `action` may be called: letters, digits, `_` and `-` only, so
/// that it stays one path segment of the service's URL (no `/`, `..` or `%`).
pub fn is_operation_name(action: &str) -> bool {
    !action.is_empty()
        && action.len() <= 64
        && action
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// Reads the body chunk by chunk, stopping past `limit` bytes.
async fn read_bounded(response: &mut reqwest::Response, limit: usize) -> Body {
    if response
        .content_length()
        .is_some_and(|length| length > limit as u64)
    {
        return Body::TooLarge;
    }
    let mut body = Vec::new();
    loop {
        match response.chunk().await {
            Ok(Some(chunk)) => {
                if body.len() + chunk.len() > limit {
                    return Body::TooLarge;
                }
                body.extend_from_slice(&chunk);
            }
            Ok(None) => return Body::Complete(body),
            Err(error) => return Body::Cut(error_chain(&error)),
        }
    }
}

/// Classifies an answer with `status` and `body` to a request of `kind`.
pub fn classify(url: &str, status: u16, kind: StepKind, body: Body, limit: usize) -> CallResult {
    if (200..300).contains(&status) {
        return match body {
            Body::Complete(bytes) => match serde_json::from_slice::<serde_json::Value>(&bytes) {
                Ok(mut value) => {
                    if make_storable(&mut value) {
                        tracing::warn!(url, "the answer held U+0000, which Postgres refuses; replaced by U+FFFD");
                        if let serde_json::Value::Object(map) = &mut value {
                            map.insert(
                                "sas_note".into(),
                                "U+0000 in the remote's answer was replaced by U+FFFD".into(),
                            );
                        }
                    }
                    CallResult::Succeeded(value)
                }
                Err(_) if bytes.is_empty() => CallResult::Unknown {
                    error: format!("{url} answered {status} with an empty body, not JSON; it may have been applied"),
                    service_failed: false,
                },
                Err(error) => CallResult::Unknown {
                    error: bounded_text(&format!(
                        "{url} answered {status} with a body that is not JSON ({} bytes, {error}); it may have been applied: {}",
                        bytes.len(),
                        String::from_utf8_lossy(&bytes)
                    )),
                    service_failed: false,
                },
            },
            Body::TooLarge => CallResult::Unknown {
                error: format!("{url} answered {status} with a body over agent.max_answer_bytes ({limit} bytes); it may have been applied"),
                service_failed: false,
            },
            Body::Cut(error) => CallResult::Unknown {
                error: bounded_text(&format!("{url} answered {status} but its body was cut ({error}); it may have been applied")),
                service_failed: true,
            },
        };
    }
    let text = match &body {
        Body::Complete(bytes) => String::from_utf8_lossy(bytes).into_owned(),
        Body::TooLarge => format!("(body over {limit} bytes)"),
        Body::Cut(error) => format!("(body cut: {error})"),
    };
    let message = bounded_text(&format!("{url} answered {status}: {text}"));
    match status {
        409 => CallResult::InProgress(message),
        404 if kind == StepKind::Compensation => CallResult::Succeeded(serde_json::json!({
            "nothing_to_undo": true,
            "remote_answer": message,
        })),
        408 | 425 | 429 => CallResult::Transient {
            error: message,
            certificate: false,
        },
        400..=499 => CallResult::Refused(message),
        500..=599 => CallResult::Unknown {
            error: format!("{message} (it may have been applied)"),
            service_failed: true,
        },
        _ => CallResult::Unknown {
            error: format!(
                "{message} (an answer the agent does not follow; it may have been applied)"
            ),
            service_failed: false,
        },
    }
}

/// `text` made safe for a reply: U+0000 replaced, at most
/// [`MAX_ERROR_CHARS`] characters.
pub fn bounded_text(text: &str) -> String {
    let mut out: String = text
        .chars()
        .take(MAX_ERROR_CHARS)
        .map(|c| if c == '\0' { REPLACEMENT } else { c })
        .collect();
    if text.chars().nth(MAX_ERROR_CHARS).is_some() {
        out.push('…');
    }
    out
}

/// An error and its causes, joined by `: `.
fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    const URL: &str = "http://remote/charge";

    fn answer(status: u16, body: &[u8]) -> CallResult {
        classify(
            URL,
            status,
            StepKind::Action,
            Body::Complete(body.to_vec()),
            1000,
        )
    }

    #[test]
    fn a_2xx_with_json_succeeds() {
        assert_eq!(
            answer(200, br#"{"id":"c-1"}"#),
            CallResult::Succeeded(serde_json::json!({"id": "c-1"}))
        );
    }

    #[test]
    fn a_2xx_that_is_not_json_empty_too_large_or_cut_has_an_unknown_outcome() {
        for body in [
            Body::Complete(b"<html>ok</html>".to_vec()),
            Body::Complete(vec![0xff, 0x00, 0x81]),
            Body::Complete(Vec::new()),
            Body::TooLarge,
            Body::Cut("reset".into()),
        ] {
            let result = classify(URL, 200, StepKind::Action, body.clone(), 1000);
            assert!(
                matches!(result, CallResult::Unknown { .. }),
                "{body:?}: {result:?}"
            );
        }
    }

    #[test]
    fn refusals_are_4xx_but_the_retryable_ones() {
        for status in [400, 401, 402, 403, 404, 410, 422] {
            assert_eq!(answer(status, b"no").class(), "refused", "{status}");
        }
        for status in [408, 425, 429] {
            assert_eq!(answer(status, b"later").class(), "transient", "{status}");
        }
        assert_eq!(answer(409, b"busy").class(), "in_progress");
        for status in [500, 502, 503, 504, 301, 303] {
            assert_eq!(answer(status, b"?").class(), "unknown", "{status}");
        }
    }

    #[test]
    fn a_404_to_a_compensation_means_nothing_to_undo() {
        let result = classify(
            URL,
            404,
            StepKind::Compensation,
            Body::Complete(b"{}".to_vec()),
            1000,
        );
        match result {
            CallResult::Succeeded(value) => assert_eq!(value["nothing_to_undo"], true),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn u0000_never_reaches_the_result_and_the_result_says_so() {
        let result = answer(200, br#"{"id":"a\u0000b","k\u0000":["\u0000"]}"#);
        let CallResult::Succeeded(value) = result else {
            panic!("{result:?}")
        };
        let text = value.to_string();
        assert!(!text.contains("\\u0000"), "{text}");
        assert_eq!(value["id"], "a\u{FFFD}b");
        assert!(value.get("k\u{FFFD}").is_some());
        assert!(value["sas_note"].as_str().unwrap().contains("U+0000"));
    }

    #[test]
    fn error_text_is_bounded_and_free_of_u0000() {
        let long = "x\0".repeat(2000);
        let CallResult::Refused(error) = answer(422, long.as_bytes()) else {
            panic!()
        };
        assert!(error.chars().count() <= MAX_ERROR_CHARS + 1);
        assert!(!error.contains('\0'));
    }

    #[test]
    fn operation_names_are_one_plain_path_segment() {
        for good in ["charge", "re-fund", "undo_2"] {
            assert!(is_operation_name(good), "{good}");
        }
        for bad in ["", "a/b", "..", "%2e%2e", "charge?x=1", "a b", "../admin"] {
            assert!(!is_operation_name(bad), "{bad}");
        }
    }
}
