//! Calling the remote service, and how its answers are classified.
//!
//! Every answer falls in one of six classes ([`CallResult`], named as in
//! the metric `sas_agent_calls_total{class}`); docs/configuration.md's
//! "Remote answers" table is the same mapping:
//!
//! | answer | class |
//! |---|---|
//! | 2xx with a JSON body of at most `agent.max_answer_bytes` (as read, and as written again) | `succeeded` |
//! | 2xx with a body over `agent.max_answer_bytes` | `applied_unusable`: fails for good, may have been applied (an action's order is undone; an undo's ends in error) |
//! | any 4xx but 408, 409, 425, 429 to an action | `refused`: nothing applied |
//! | any 4xx but 408, 409, 425, 429 to a compensation, 404 included | `refused`: the undo is not proven (the order ends in error with an alert) |
//! | connect error (refused, DNS, TLS handshake, certificate), 408, 425 | `transient`: nothing applied |
//! | 429 | `throttled`: nothing applied; its `Retry-After` pauses the lane ([`crate::pause`]) |
//! | 503 with `Retry-After` | `throttled`: may have been applied; the lane pauses |
//! | 409 | `in_progress`: retry the same key later |
//! | timeout or reset after sending, any other 5xx, 1xx/3xx, a 2xx whose body is not JSON, empty or cut | `unknown`: may have been applied |
//!
//! A 503 too: a gateway can answer it after the service behind it took the
//! request, so it is never read as "nothing applied".
//!
//! "Undone" needs proof: a 404 to an undo proves only that something
//! answered 404 at that URL (a misspelt or renamed route, an ingress
//! without the route, a service that has not seen the action yet), not
//! that the action was undone, so it is a refusal like any other 4xx. The
//! state machine sends an undo only for a step whose action did or may have
//! happened.
//!
//! A 2xx answer over `agent.max_answer_bytes` (at most a quarter of
//! `amqp.max_message_bytes`) is not retried: the service answered, the same
//! key would get the same answer, and a result that large would not fit in
//! the reply, or in the later requests that carry it beside the order and
//! the other steps' results.
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
    /// A 2xx answer the agent cannot carry: its body is over
    /// `agent.max_answer_bytes`. The action was (or may have been) applied,
    /// and asking again gets the same answer: a permanent failure that may
    /// have been applied, so the order is undone. The service answered, so
    /// it does not count against the circuit.
    AppliedButUnusable(String),
    /// Refused for good: retrying cannot help. Of an action, nothing was
    /// applied; of a compensation, the undo is not proven.
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
    /// The service asked to slow down: a 429 (nothing applied), or a 503
    /// with `Retry-After` (which a proxy may send after the service took
    /// the request: maybe applied). Its `Retry-After` pauses the lane
    /// ([`crate::pause`]); not a failure of the service.
    Throttled {
        /// What happened.
        error: String,
        /// The pause it asked for, if it named one.
        retry_after: Option<Duration>,
        /// A 503: the call may have been applied.
        maybe_applied: bool,
    },
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
    /// The class name, for logs and the metric `sas_agent_calls_total{class}`:
    /// `succeeded`, `applied_unusable`, `refused`, `transient`,
    /// `in_progress`, `throttled` or `unknown`.
    pub fn class(&self) -> &'static str {
        match self {
            Self::Succeeded(_) => "succeeded",
            Self::AppliedButUnusable(_) => "applied_unusable",
            Self::Refused(_) => "refused",
            Self::Transient { .. } => "transient",
            Self::InProgress(_) => "in_progress",
            Self::Throttled { .. } => "throttled",
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
    /// `agent.remote_headers`, added to every call.
    headers: reqwest::header::HeaderMap,
    max_answer_bytes: usize,
    agent: String,
}

impl RemoteClient {
    /// A client of agent `agent` for the service at `base_url`, with the TLS
    /// roots, client identity and credentials of `settings`.
    ///
    /// # Errors
    /// When a TLS file, the credentials or `agent.remote_headers` are
    /// unusable, or the HTTP client cannot be built.
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
        let headers = settings.remote_header_map().map_err(anyhow::Error::msg)?;
        Ok(Self {
            http: builder.build()?,
            base_url: base_url.trim_end_matches('/').to_owned(),
            auth,
            headers,
            max_answer_bytes: settings.max_answer_bytes,
            agent: agent.to_owned(),
        })
    }

    /// The service's base URL.
    pub fn base_url(&self) -> &str {
        &self.base_url
    }

    /// Sends the request's payload as JSON with its method ([`call_method`])
    /// to its URL ([`RemoteClient::url_of`]), with its idempotency key, the
    /// order's trace context (`traceparent`: a child of the current span
    /// when spans are exported, else of the order's trace `trace_id`),
    /// `agent.remote_auth_header` and `agent.remote_headers`, waiting at
    /// most `timeout`. The request must have passed [`check_request`]; one
    /// that does not is refused here without a call.
    pub async fn call(
        &self,
        request: &StepRequest,
        timeout: Duration,
        trace_id: Option<&str>,
    ) -> CallResult {
        if let Err(reason) = check_request(request) {
            return CallResult::Refused(reason);
        }
        let url = self.url_of(request);
        let method = call_method(request);
        let span = tracing::info_span!("call", method = %method, url = %url, idempotency_key = %request.idempotency_key);
        let traceparent = span
            .in_scope(sas_runtime::telemetry::current_traceparent)
            .or_else(|| trace_id.map(|id| sas_messages::TraceParent::child_of(id).to_string()));
        let mut builder = self
            .http
            .request(method, &url)
            .headers(self.headers.clone())
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
        let asked = matches!(status, 429 | 503)
            .then(|| {
                response
                    .headers()
                    .get(reqwest::header::RETRY_AFTER)
                    .and_then(|value| value.to_str().ok())
                    .and_then(crate::pause::retry_after)
            })
            .flatten();
        let body = read_bounded(&mut response, self.max_answer_bytes).await;
        throttled(
            classify(&url, status, request.kind, body, self.max_answer_bytes),
            status,
            asked,
        )
    }

    /// The URL a request calls: `<base_url><path>` when it names a path,
    /// else `<base_url>/<action>`.
    pub fn url_of(&self, request: &StepRequest) -> String {
        match &request.path {
            Some(path) => format!("{}{path}", self.base_url),
            None => format!("{}/{}", self.base_url, request.action),
        }
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

/// The HTTP methods a call may use ([`StepRequest::method`], written as
/// here: methods are case-sensitive); `POST` when the request names none.
pub const CALL_METHODS: [&str; 4] = ["POST", "PUT", "PATCH", "DELETE"];

/// Longest call path ([`StepRequest::path`]), in bytes.
pub const MAX_CALL_PATH_BYTES: usize = 512;

/// Why `request` must not be called, or `Ok` when it may be: its action is
/// an operation name ([`is_operation_name`]), its method, if any, one of
/// [`CALL_METHODS`], and its path, if any, a call path ([`is_call_path`]).
/// The reason names the field and its value and ends in "no call made".
///
/// # Errors
/// The first field that is wrong, as above.
pub fn check_request(request: &StepRequest) -> Result<(), String> {
    if !is_operation_name(&request.action) {
        return Err(format!(
            "action {:?} is not an operation name (1 to 64 letters, digits, '_' or '-'); no call made",
            bounded_text(&request.action)
        ));
    }
    if let Some(method) = &request.method {
        if !CALL_METHODS.contains(&method.as_str()) {
            return Err(format!(
                "method {:?} is not a call method (POST, PUT, PATCH or DELETE, in capitals); no call made",
                bounded_text(method)
            ));
        }
    }
    if let Some(path) = &request.path {
        if !is_call_path(path) {
            return Err(format!(
                "path {:?} is not a call path ('/' and non-empty segments of letters, digits, -._~!$&'()*+,;=:@ or %XX escapes, at most {MAX_CALL_PATH_BYTES} bytes, no '.' or '..' segment, no '?' or '#'); no call made",
                bounded_text(path)
            ));
        }
    }
    Ok(())
}

/// The method of a request's call: its own, `POST` when it names none. A
/// method outside [`CALL_METHODS`] (which [`check_request`] refuses) is
/// read as `POST`.
pub fn call_method(request: &StepRequest) -> reqwest::Method {
    match request.method.as_deref() {
        Some("PUT") => reqwest::Method::PUT,
        Some("PATCH") => reqwest::Method::PATCH,
        Some("DELETE") => reqwest::Method::DELETE,
        _ => reqwest::Method::POST,
    }
}

/// Whether `path` may be appended to the service's base URL: `/` then
/// segments separated by `/`, at most [`MAX_CALL_PATH_BYTES`] bytes in all,
/// each segment non-empty and made of RFC 3986 unreserved characters
/// (letters, digits, `-._~`), `%` and two hex digits, sub-delims
/// (`!$&'()*+,;=`), `:` and `@`. No segment is `.` or `..`, written plainly
/// or percent-encoded (`%2e`: URL parsers resolve it as a dot), so the
/// call cannot leave the base URL; no `?` or `#`.
pub fn is_call_path(path: &str) -> bool {
    path.len() <= MAX_CALL_PATH_BYTES
        && path
            .strip_prefix('/')
            .is_some_and(|segments| segments.split('/').all(is_path_segment))
}

/// One segment of a call path (see [`is_call_path`]).
fn is_path_segment(segment: &str) -> bool {
    let bytes = segment.as_bytes();
    let mut at = 0;
    while at < bytes.len() {
        match bytes[at] {
            b'%' => {
                let escape = bytes.get(at + 1..at + 3);
                if !escape.is_some_and(|hex| hex.iter().all(u8::is_ascii_hexdigit)) {
                    return false;
                }
                at += 3;
            }
            b if b.is_ascii_alphanumeric() || b"-._~!$&'()*+,;=:@".contains(&b) => at += 1,
            _ => return false,
        }
    }
    let dots = segment.replace("%2e", ".").replace("%2E", ".");
    !segment.is_empty() && dots != "." && dots != ".."
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

/// Classifies an answer with `status` and `body` to a request of `kind`;
/// `limit` is `agent.max_answer_bytes`.
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
                    // What travels on is the value written again, which can
                    // be longer than what was read (`1e15` is written in
                    // full): bounded alike.
                    let written = serde_json::to_vec(&value).map_or(usize::MAX, |v| v.len());
                    if written > limit {
                        return too_large(url, status, kind, &format!("a JSON body of {written} bytes once written again, over {limit} bytes"));
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
            Body::TooLarge => too_large(url, status, kind, &format!("a body of over {limit} bytes")),
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
        408 | 425 | 429 => CallResult::Transient {
            error: message,
            certificate: false,
        },
        400..=499 if kind == StepKind::Compensation => {
            CallResult::Refused(undo_refused(url, status, &text))
        }
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

/// A 429, or a 503 that names a `Retry-After`, as the service asking to
/// slow down ([`CallResult::Throttled`]); any other answer as classified.
fn throttled(result: CallResult, status: u16, retry_after: Option<Duration>) -> CallResult {
    match (status, result) {
        (429, CallResult::Transient { error, .. }) => CallResult::Throttled {
            error,
            retry_after,
            maybe_applied: false,
        },
        (503, CallResult::Unknown { error, .. }) if retry_after.is_some() => {
            CallResult::Throttled {
                error,
                retry_after,
                maybe_applied: true,
            }
        }
        (_, result) => result,
    }
}

/// Longest URL quoted in an error text, in characters: the text must keep
/// room for what happened and what to do within [`MAX_ERROR_CHARS`].
const QUOTED_URL_CHARS: usize = 160;

/// Longest piece of an answer's body quoted in an error text, in characters.
const QUOTED_BODY_CHARS: usize = 120;

/// A 2xx answer over `agent.max_answer_bytes`, `what` saying how large:
/// applied (or maybe), unusable, and the same again if asked again.
fn too_large(url: &str, status: u16, kind: StepKind, what: &str) -> CallResult {
    let url = clipped(url, QUOTED_URL_CHARS);
    let text = match kind {
        StepKind::Action => format!(
            "{url} answered {status} with {what} (agent.max_answer_bytes); the action may have been applied; the order is undone; shorten the answer or raise agent.max_answer_bytes (at most a quarter of amqp.max_message_bytes)"
        ),
        StepKind::Compensation => format!(
            "{url} answered {status} to the undo with {what} (agent.max_answer_bytes); the undo may have been applied, but its answer cannot be kept to prove it; check the action at the remote, then resubmit the order or resolve its alert; shorten the answer or raise agent.max_answer_bytes (at most a quarter of amqp.max_message_bytes)"
        ),
    };
    CallResult::AppliedButUnusable(bounded_text(&text))
}

/// The refusal of an undo answered `status` (a 4xx) with `body`: it names
/// the URL, the status and the answer, and says that it proves nothing
/// undone.
fn undo_refused(url: &str, status: u16, body: &str) -> String {
    let url = clipped(url, QUOTED_URL_CHARS);
    let body = match body.trim() {
        "" => "an empty body".to_owned(),
        body => format!("\"{}\"", clipped(body, QUOTED_BODY_CHARS)),
    };
    let why = if status == 404 {
        "a 404 does not prove the action was undone (a misspelt or renamed route, or an ingress without it, answers 404 too)"
    } else {
        "the undo was refused; nothing proves the action was undone"
    };
    bounded_text(&format!(
        "{url} answered {status} to the undo, with {body}: {why}; check the compensation's route and the action at the remote, undo it by hand if need be, then resubmit the order or resolve its alert"
    ))
}

/// At most `max` characters of `text`, with `…` when cut.
fn clipped(text: &str, max: usize) -> String {
    if text.chars().nth(max).is_none() {
        return text.to_owned();
    }
    let mut out: String = text.chars().take(max).collect();
    out.push('…');
    out
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
    #[test]
    fn a_429_is_throttled_not_applied_and_a_503_naming_a_pause_is_throttled_maybe_applied() {
        let pause = Some(Duration::from_secs(2));
        let slow_down = throttled(
            classify(
                URL,
                429,
                StepKind::Action,
                Body::Complete(b"{}".to_vec()),
                1000,
            ),
            429,
            pause,
        );
        assert!(
            matches!(
                slow_down,
                CallResult::Throttled {
                    retry_after: Some(_),
                    maybe_applied: false,
                    ..
                }
            ),
            "{slow_down:?}"
        );
        let busy = throttled(
            classify(URL, 503, StepKind::Action, Body::Complete(Vec::new()), 1000),
            503,
            pause,
        );
        assert!(
            matches!(
                busy,
                CallResult::Throttled {
                    maybe_applied: true,
                    ..
                }
            ),
            "{busy:?}"
        );
        // A 503 without Retry-After stays unknown; other answers unchanged.
        let unknown = throttled(
            classify(URL, 503, StepKind::Action, Body::Complete(Vec::new()), 1000),
            503,
            None,
        );
        assert_eq!(unknown.class(), "unknown");
        let refused = throttled(
            classify(URL, 422, StepKind::Action, Body::Complete(Vec::new()), 1000),
            422,
            pause,
        );
        assert_eq!(refused.class(), "refused");
    }

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
    fn a_2xx_that_is_not_json_empty_or_cut_has_an_unknown_outcome() {
        for body in [
            Body::Complete(b"<html>ok</html>".to_vec()),
            Body::Complete(vec![0xff, 0x00, 0x81]),
            Body::Complete(Vec::new()),
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
    fn a_2xx_over_the_answer_limit_was_applied_and_fails_for_good() {
        for kind in [StepKind::Action, StepKind::Compensation] {
            let result = classify(URL, 200, kind, Body::TooLarge, 1000);
            assert_eq!(result.class(), "applied_unusable", "{kind:?}");
            let CallResult::AppliedButUnusable(error) = result else {
                panic!("{kind:?}: {result:?}")
            };
            assert!(error.starts_with(&format!("{URL} answered 200")), "{error}");
            assert!(error.contains("over 1000 bytes"), "{error}");
            assert!(error.contains("agent.max_answer_bytes"), "{error}");
            assert!(error.contains("may have been applied"), "{error}");
            assert!(error.chars().count() <= MAX_ERROR_CHARS, "{error}");
            match kind {
                StepKind::Action => assert!(error.contains("the order is undone"), "{error}"),
                StepKind::Compensation => {
                    assert!(error.contains("to the undo"), "{error}");
                    assert!(!error.contains("the order is undone"), "{error}");
                }
            }
        }
    }

    #[test]
    fn a_2xx_whose_json_grows_past_the_limit_once_written_again_is_unusable_too() {
        // 5 bytes each as read, 19 as written again: 1000 bytes read, 3800
        // in the reply.
        let numbers = vec!["9e15"; 199].join(",");
        let body = format!("[{numbers}]");
        assert!(body.len() <= 1000);
        let result = answer(200, body.as_bytes());
        let CallResult::AppliedButUnusable(error) = result else {
            panic!("{result:?}")
        };
        assert!(error.contains("once written again"), "{error}");
        assert_eq!(answer(200, b"[9e15]").class(), "succeeded");
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
    fn a_404_to_a_compensation_is_a_refusal_that_proves_nothing_undone() {
        let result = classify(
            URL,
            404,
            StepKind::Compensation,
            Body::Complete(b"{\"error\":\"no route\"}".to_vec()),
            1000,
        );
        let CallResult::Refused(error) = result else {
            panic!("a 404 to an undo must be refused for good, got {result:?}")
        };
        assert!(error.contains(URL), "names the route: {error}");
        assert!(error.contains("404"), "{error}");
        assert!(error.contains("no route"), "the answer: {error}");
        assert!(
            error.contains("does not prove the action was undone"),
            "{error}"
        );
        assert!(!error.contains("nothing_to_undo"), "{error}");
        assert!(error.chars().count() <= MAX_ERROR_CHARS + 1, "{error}");
    }

    #[test]
    fn every_4xx_refusal_of_an_undo_names_the_route_and_proves_nothing_undone() {
        let undo = |status: u16, body: &[u8]| {
            classify(
                URL,
                status,
                StepKind::Compensation,
                Body::Complete(body.to_vec()),
                1000,
            )
        };
        for status in [400, 401, 403, 410, 422] {
            let CallResult::Refused(error) = undo(status, b"gone") else {
                panic!("{status}")
            };
            assert!(
                error.starts_with(&format!("{URL} answered {status} to the undo")),
                "{error}"
            );
            assert!(error.contains("\"gone\""), "{error}");
            assert!(
                error.contains("nothing proves the action was undone"),
                "{error}"
            );
        }
        for status in [408, 425, 429] {
            assert_eq!(undo(status, b"later").class(), "transient", "{status}");
        }
        assert_eq!(undo(409, b"busy").class(), "in_progress");
        // A long route and a long answer leave the verdict in the text.
        let long_url = format!("http://remote/{}", "r".repeat(600));
        let result = classify(
            &long_url,
            404,
            StepKind::Compensation,
            Body::Complete("x".repeat(5000).into_bytes()),
            1000,
        );
        let CallResult::Refused(error) = result else {
            panic!("{result:?}")
        };
        assert!(error.chars().count() <= MAX_ERROR_CHARS + 1, "{error}");
        assert!(
            error.contains("does not prove the action was undone"),
            "{error}"
        );
        let CallResult::Refused(empty) = undo(404, b"") else {
            panic!()
        };
        assert!(empty.contains("with an empty body"), "{empty}");
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

    #[test]
    fn call_paths_are_plain_segments_under_the_base_url() {
        for good in [
            "/charge",
            "/v2/orders/o-1/refunds",
            "/a.b/c~d/_e-f",
            "/items/sku%2F1",
            "/%C3%A9t%C3%A9",
            "/x/!$&'()*+,;=:@",
            "/...",
            "/.hidden",
        ] {
            assert!(is_call_path(good), "{good}");
        }
        let long_enough = format!("/{}", "a".repeat(MAX_CALL_PATH_BYTES - 1));
        assert!(is_call_path(&long_enough));
        let too_long = format!("/{}", "a".repeat(MAX_CALL_PATH_BYTES));
        for bad in [
            "",
            "/",
            "charge",
            "//charge",
            "/a//b",
            "/a/",
            "/.",
            "/a/./b",
            "/../admin",
            "/a/..",
            "/%2e%2e/admin",
            "/%2E./admin",
            "/.%2e",
            "/%2e",
            "/a?b=1",
            "/a#top",
            "/a b",
            "/a%",
            "/a%2",
            "/a%zz",
            "/a\\b",
            "/é",
            "/a\"b",
            "/<x>",
            "/a\nb",
            too_long.as_str(),
        ] {
            assert!(!is_call_path(bad), "{bad:?}");
        }
    }

    fn request(method: Option<&str>, path: Option<&str>) -> StepRequest {
        StepRequest {
            schema_version: sas_messages::SCHEMA_VERSION,
            order_id: "o-1".into(),
            step: "refund".into(),
            kind: StepKind::Action,
            action: "credit".into(),
            attempt_id: sas_messages::AttemptId::new(),
            attempt: 1,
            idempotency_key: "o-1:refund".into(),
            complete_by: chrono::Utc::now() + chrono::Duration::seconds(30),
            start_by: None,
            dispatched_at: None,
            payload: serde_json::json!({"amount_cents": 250}),
            method: method.map(str::to_owned),
            path: path.map(str::to_owned),
            limit_key: None,
        }
    }

    #[test]
    fn a_request_with_a_bad_action_method_or_path_is_refused_naming_the_field() {
        for method in [
            None,
            Some("POST"),
            Some("PUT"),
            Some("PATCH"),
            Some("DELETE"),
        ] {
            assert_eq!(check_request(&request(method, Some("/v1/credits"))), Ok(()));
        }
        assert_eq!(check_request(&request(None, None)), Ok(()));
        for method in [
            "GET", "post", "Put", "HEAD", "OPTIONS", "CONNECT", "", "POST ",
        ] {
            let reason = check_request(&request(Some(method), None)).unwrap_err();
            assert!(
                reason.starts_with(&format!("method {method:?} is not a call method")),
                "{reason}"
            );
            assert!(reason.ends_with("no call made"), "{reason}");
        }
        for path in ["credits", "/a/../b", "/a?x=1", "/"] {
            let reason = check_request(&request(None, Some(path))).unwrap_err();
            assert!(
                reason.starts_with(&format!("path {path:?} is not a call path")),
                "{reason}"
            );
            assert!(reason.ends_with("no call made"), "{reason}");
        }
        let mut bad_action = request(Some("PUT"), Some("/v1/credits"));
        bad_action.action = "../admin".into();
        let reason = check_request(&bad_action).unwrap_err();
        assert!(reason.starts_with("action \"../admin\""), "{reason}");
    }

    #[test]
    fn the_method_is_the_requests_own_or_post() {
        assert_eq!(call_method(&request(None, None)), reqwest::Method::POST);
        for (method, expected) in [
            ("POST", reqwest::Method::POST),
            ("PUT", reqwest::Method::PUT),
            ("PATCH", reqwest::Method::PATCH),
            ("DELETE", reqwest::Method::DELETE),
        ] {
            assert_eq!(call_method(&request(Some(method), None)), expected);
        }
    }

    fn settings(remote_headers: &str) -> AgentSettings {
        AgentSettings {
            name: "payment".into(),
            id: String::new(),
            remote_url: "http://127.0.0.1:1/payment".into(),
            remote_ca_file: String::new(),
            remote_client_cert_file: String::new(),
            remote_client_key_file: String::new(),
            remote_auth_header: crate::settings::Secret::new("Bearer s3cret"),
            remote_headers: remote_headers.into(),
            max_answer_bytes: 16384,
            start_margin_ms: 1000,
            clock_offset_ms: 0,
            call_timeout_ms: 5000,
            concurrency: 1,
            retry_base_ms: 50,
            retry_max_ms: 2000,
            max_pause_ms: 300_000,
            drain_ms: 1000,
        }
    }

    #[test]
    fn the_url_is_the_base_and_the_path_or_the_action() {
        let client = RemoteClient::new("payment", "http://remote/payment/", &settings("")).unwrap();
        assert_eq!(
            client.url_of(&request(None, None)),
            "http://remote/payment/credit"
        );
        assert_eq!(
            client.url_of(&request(Some("PUT"), Some("/v1/accounts/a%2F1/credits"))),
            "http://remote/payment/v1/accounts/a%2F1/credits"
        );
    }

    #[test]
    fn unusable_remote_headers_stop_the_client_from_being_built() {
        let error = RemoteClient::new("payment", "http://remote", &settings("Host: evil"))
            .unwrap_err()
            .to_string();
        assert!(error.contains("agent.remote_headers"), "{error}");
    }

    /// Serves one HTTP/1.1 call on a free port and answers `{}`; returns
    /// its base URL and the request as received (head and body).
    async fn one_call_server() -> (String, tokio::task::JoinHandle<String>) {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let server = tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            let mut received = Vec::new();
            let mut buffer = [0u8; 4096];
            loop {
                let read = stream.read(&mut buffer).await.unwrap();
                assert!(read > 0, "the call ended early");
                received.extend_from_slice(&buffer[..read]);
                let text = String::from_utf8_lossy(&received).into_owned();
                if let Some(end) = text.find("\r\n\r\n") {
                    let length = text[..end]
                        .lines()
                        .find_map(|line| {
                            let (name, value) = line.split_once(':')?;
                            name.eq_ignore_ascii_case("content-length")
                                .then(|| value.trim().parse::<usize>().ok())?
                        })
                        .unwrap_or(0);
                    if received.len() >= end + 4 + length {
                        break;
                    }
                }
            }
            stream
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}")
                .await
                .unwrap();
            String::from_utf8(received).unwrap()
        });
        (base, server)
    }

    #[tokio::test]
    async fn a_call_uses_the_requests_method_and_path_and_adds_the_configured_headers() {
        let (base, server) = one_call_server().await;
        let client = RemoteClient::new(
            "payment",
            &format!("{base}/payment"),
            &settings("X-Api-Version: 2; X-Tenant: acme"),
        )
        .unwrap();
        let request = request(Some("PUT"), Some("/v1/accounts/a%2F1/credits"));
        let result = client.call(&request, Duration::from_secs(5), None).await;
        assert_eq!(result, CallResult::Succeeded(serde_json::json!({})));
        let received = server.await.unwrap();
        let (head, body) = received.split_once("\r\n\r\n").unwrap();
        let mut lines = head.lines();
        assert_eq!(
            lines.next(),
            Some("PUT /payment/v1/accounts/a%2F1/credits HTTP/1.1")
        );
        let headers: Vec<String> = lines.map(str::to_ascii_lowercase).collect();
        for expected in [
            "x-api-version: 2",
            "x-tenant: acme",
            "idempotency-key: o-1:refund",
            "authorization: bearer s3cret",
            "content-type: application/json",
        ] {
            assert!(headers.iter().any(|h| h == expected), "{expected}: {head}");
        }
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(body).unwrap(),
            serde_json::json!({"amount_cents": 250})
        );
    }

    #[tokio::test]
    async fn a_request_with_a_bad_path_is_refused_without_a_call() {
        // Nothing listens there: a call would be a transient failure.
        let client = RemoteClient::new("payment", "http://127.0.0.1:1", &settings("")).unwrap();
        let result = client
            .call(
                &request(None, Some("/../admin")),
                Duration::from_secs(5),
                None,
            )
            .await;
        assert!(
            matches!(&result, CallResult::Refused(reason) if reason.starts_with("path \"/../admin\"")),
            "{result:?}"
        );
    }
}
