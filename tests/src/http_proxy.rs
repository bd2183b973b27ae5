//! An HTTP reverse proxy between an agent and its remote service that holds
//! chosen calls for a while and then delivers them anyway, even when the
//! agent has hung up meanwhile: a late action, as a slow network or a
//! provider's queue makes one.
//!
//! remote-sim (and [`crate::strict_remote`]) apply a call the moment it
//! arrives, so an agent that gives up on a call ("outcome unknown") has
//! always been overtaken by the call itself: what it may do next (retry,
//! compensate) always comes after the action. Put [`HoldProxy`] in front of
//! the service (the agent's `remote_url` is [`HoldProxy::url`]) and
//! [`HoldProxy::hold`] the call: it reaches the service only after the hold,
//! possibly after the agent's retries and compensation, which is what a test
//! of late actions needs to show.
//!
//! Every request is written in a journal ([`HoldProxy::journal`]): when it
//! arrived, how long it was held, when it was forwarded, what the upstream
//! answered and whether the client was still there to hear it.
//!
//! How a call outlives its client: the proxy's handler (axum) reads the
//! request, spawns a task that holds and forwards it, and awaits the task's
//! answer through a oneshot channel. When the client hangs up, hyper notices
//! the end of the connection and drops the handler, and with it the
//! receiving end; the spawned task is not the handler's, so it goes on,
//! forwards the request after its hold, records the upstream's answer, and
//! finds the receiver gone (the client was not connected any more).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::Response;
use chrono::{DateTime, Utc};
use tokio::sync::{oneshot, watch};

/// Largest request body the proxy reads (a call's JSON is far smaller).
const MAX_BODY_BYTES: usize = 16 * 1024 * 1024;

/// Longest the proxy waits for the upstream once it forwards a request:
/// long enough for any answer a test makes slow on purpose.
const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(300);

/// Headers that describe one connection, not the message (RFC 9110, 7.6.1),
/// and those the HTTP client sets itself: never forwarded either way.
const HOP_BY_HOP: [&str; 10] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "host",
];

/// A running proxy on a free port of 127.0.0.1; it stops listening when
/// dropped (requests it holds are still forwarded while the runtime runs).
pub struct HoldProxy {
    url: String,
    shared: Arc<Shared>,
    server: tokio::task::JoinHandle<()>,
}

/// One request through the proxy, as the journal keeps it: what a test reads
/// to show when a call reached the service, and that its caller had given up.
#[derive(Debug, Clone, PartialEq)]
pub struct Passage {
    /// The request's method, as sent (`POST`).
    pub method: String,
    /// The request's path, without the query (`/charges`).
    pub path: String,
    /// The query, without `?`, when there was one.
    pub query: Option<String>,
    /// The request's `Idempotency-Key` header, when it had one.
    pub idempotency_key: Option<String>,
    /// When the request arrived at the proxy.
    pub arrived_at: DateTime<Utc>,
    /// How long it was to be held before forwarding (`None`: not held).
    pub held_for: Option<Duration>,
    /// When the proxy sent it on to the upstream (`None`: not yet).
    pub forwarded_at: Option<DateTime<Utc>>,
    /// When the upstream's answer (or the failure to get one) came back.
    pub answered_at: Option<DateTime<Utc>>,
    /// The upstream's status (`None`: not answered yet, or no answer).
    pub status: Option<u16>,
    /// Why the upstream gave no answer (the proxy then answers 502).
    pub upstream_error: Option<String>,
    /// Whether the client was still waiting when the answer came (`None`:
    /// no answer yet). `false` is a call its client gave up on that still
    /// reached the service.
    pub client_connected: Option<bool>,
}

impl Passage {
    /// Whether the request's forwarding is over: the upstream answered, or
    /// could not be reached.
    pub fn done(&self) -> bool {
        self.answered_at.is_some()
    }
}

/// A rule of [`HoldProxy::hold`].
#[derive(Debug, Clone)]
struct Hold {
    method: String,
    path: String,
    for_: Duration,
}

struct Shared {
    upstream: String,
    client: reqwest::Client,
    holds: Mutex<Vec<Hold>>,
    journal: Mutex<Vec<Passage>>,
    /// Bumped by [`HoldProxy::release_all`]: every held request goes at once.
    release: watch::Sender<u64>,
}

impl Shared {
    fn hold_for(&self, method: &str, path: &str) -> Option<Duration> {
        self.holds
            .lock()
            .expect("holds")
            .iter()
            .find(|hold| hold.method == method && hold.path == path)
            .map(|hold| hold.for_)
    }

    fn record(&self, index: usize, update: impl FnOnce(&mut Passage)) {
        update(&mut self.journal.lock().expect("journal")[index]);
    }
}

impl HoldProxy {
    /// Starts a proxy on a free port of 127.0.0.1 in front of `upstream`, a
    /// base URL (`http://127.0.0.1:PORT`, a trailing `/` ignored): a request
    /// for `<proxy>/a/b?c` goes to `<upstream>/a/b?c`.
    ///
    /// # Panics
    /// When no port can be bound or the HTTP client cannot be built.
    pub async fn start(upstream: &str) -> Self {
        crate::install_crypto_provider();
        let client = reqwest::Client::builder()
            // Relay a redirect as it is, as a proxy does.
            .redirect(reqwest::redirect::Policy::none())
            .timeout(UPSTREAM_TIMEOUT)
            .build()
            .expect("the proxy's HTTP client");
        let shared = Arc::new(Shared {
            upstream: upstream.trim_end_matches('/').to_owned(),
            client,
            holds: Mutex::new(Vec::new()),
            journal: Mutex::new(Vec::new()),
            release: watch::Sender::new(0),
        });
        let app = axum::Router::new()
            .fallback(relay)
            .with_state(shared.clone());
        let (port, server) = crate::serve_locally(app).await;
        let url = format!("http://127.0.0.1:{port}");
        Self {
            url,
            shared,
            server,
        }
    }

    /// The proxy's base URL (`http://127.0.0.1:PORT`, no trailing `/`): the
    /// agent's `remote_url`.
    pub fn url(&self) -> String {
        self.url.clone()
    }

    /// From now on, holds every request with method `method` (exactly:
    /// `"POST"`, not `"post"`) and path `path` (exactly, the query aside) for
    /// `for_` before forwarding it, whether its client waits or not. A new
    /// hold for the same method and path replaces the old one; requests
    /// already held keep theirs.
    pub fn hold(&self, method: &str, path: &str, for_: Duration) {
        let mut holds = self.shared.holds.lock().expect("holds");
        holds.retain(|hold| !(hold.method == method && hold.path == path));
        holds.push(Hold {
            method: method.to_owned(),
            path: path.to_owned(),
            for_,
        });
    }

    /// From now on, holds nothing; requests already held keep their hold.
    pub fn clear_holds(&self) {
        self.shared.holds.lock().expect("holds").clear();
    }

    /// Holds nothing from now on, and forwards every request held now at
    /// once (their clients may have hung up: they are forwarded anyway).
    pub fn release_all(&self) {
        self.clear_holds();
        self.shared
            .release
            .send_modify(|generation| *generation += 1);
    }

    /// Every request through the proxy so far, in the order they arrived.
    pub fn journal(&self) -> Vec<Passage> {
        self.shared.journal.lock().expect("journal").clone()
    }

    /// Waits until at least `n` held requests have been forwarded and
    /// answered by the upstream (or failed to reach it), polling, and
    /// returns them in the order they arrived: after it, the upstream has
    /// seen them.
    ///
    /// # Panics
    /// When fewer than `n` are done within `timeout`, with the journal.
    pub async fn wait_forwarded(&self, n: usize, timeout: Duration) -> Vec<Passage> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let done: Vec<Passage> = self
                .journal()
                .into_iter()
                .filter(|passage| passage.held_for.is_some() && passage.done())
                .collect();
            if done.len() >= n {
                return done;
            }
            if tokio::time::Instant::now() >= deadline {
                panic!(
                    "{} of {n} held requests forwarded within {timeout:?}; journal: {:#?}",
                    done.len(),
                    self.journal()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for HoldProxy {
    fn drop(&mut self) {
        self.server.abort();
    }
}

/// The proxy's one handler: journals the request, hands it to a task of its
/// own (which holds and forwards it) and relays that task's answer, if the
/// client is still there to get it.
async fn relay(State(shared): State<Arc<Shared>>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let body = match axum::body::to_bytes(body, MAX_BODY_BYTES).await {
        Ok(body) => body,
        Err(error) => {
            return plain(
                StatusCode::BAD_REQUEST,
                format!("the proxy could not read the body: {error}"),
            )
        }
    };
    let method = parts.method.as_str().to_owned();
    let path = parts.uri.path().to_owned();
    let query = parts.uri.query().map(str::to_owned);
    let path_and_query = parts
        .uri
        .path_and_query()
        .map_or_else(|| path.clone(), |pq| pq.as_str().to_owned());
    let held_for = shared.hold_for(&method, &path);
    let idempotency_key = parts
        .headers
        .get("idempotency-key")
        .and_then(|value| value.to_str().ok())
        .map(str::to_owned);
    let index = {
        let mut journal = shared.journal.lock().expect("journal");
        journal.push(Passage {
            method,
            path,
            query,
            idempotency_key,
            arrived_at: Utc::now(),
            held_for,
            forwarded_at: None,
            answered_at: None,
            status: None,
            upstream_error: None,
            client_connected: None,
        });
        journal.len() - 1
    };
    let (answer, answered) = oneshot::channel();
    let outbound = Outbound {
        index,
        held_for,
        method: parts.method,
        url: format!("{}{path_and_query}", shared.upstream),
        headers: end_to_end(&parts.headers),
        body,
    };
    // Not awaited here: when the client hangs up this handler is dropped,
    // the task is not.
    tokio::spawn(forward(shared, outbound, answer));
    answered.await.unwrap_or_else(|_| {
        plain(
            StatusCode::INTERNAL_SERVER_ERROR,
            "the proxy's forwarding task ended without an answer".into(),
        )
    })
}

/// A request on its way to the upstream.
struct Outbound {
    index: usize,
    held_for: Option<Duration>,
    method: Method,
    url: String,
    headers: HeaderMap,
    body: axum::body::Bytes,
}

/// Holds `outbound` (until its hold ends or [`HoldProxy::release_all`]),
/// forwards it, journals the upstream's answer and hands it to the handler,
/// noting whether the handler (the client) was still waiting.
async fn forward(shared: Arc<Shared>, outbound: Outbound, answer: oneshot::Sender<Response>) {
    if let Some(hold) = outbound.held_for {
        let mut release = shared.release.subscribe();
        tokio::select! {
            () = tokio::time::sleep(hold) => {}
            _ = release.changed() => {}
        }
    }
    shared.record(outbound.index, |passage| {
        passage.forwarded_at = Some(Utc::now());
    });
    let sent = shared
        .client
        .request(outbound.method, &outbound.url)
        .headers(outbound.headers)
        .body(outbound.body)
        .send()
        .await;
    let (status, error, response) = match sent {
        Ok(upstream) => {
            let status = upstream.status();
            let headers = end_to_end(upstream.headers());
            match upstream.bytes().await {
                Ok(bytes) => {
                    let mut response = Response::new(Body::from(bytes));
                    *response.status_mut() = status;
                    *response.headers_mut() = headers;
                    (Some(status.as_u16()), None, response)
                }
                Err(error) => {
                    let error = format!("the upstream's body was cut: {error}");
                    (
                        Some(status.as_u16()),
                        Some(error.clone()),
                        plain(StatusCode::BAD_GATEWAY, error),
                    )
                }
            }
        }
        Err(error) => {
            let error = format!("cannot reach the upstream: {error}");
            (
                None,
                Some(error.clone()),
                plain(StatusCode::BAD_GATEWAY, error),
            )
        }
    };
    let answered_at = Utc::now();
    let connected = answer.send(response).is_ok();
    shared.record(outbound.index, |passage| {
        passage.answered_at = Some(answered_at);
        passage.status = status;
        passage.upstream_error = error;
        passage.client_connected = Some(connected);
    });
}

/// The headers of `headers` that belong to the message, not the connection:
/// hop-by-hop headers, those named in `Connection`, `Host` and
/// `Content-Length` (the client sets the last two) left out.
fn end_to_end(headers: &HeaderMap) -> HeaderMap {
    let named: Vec<String> = headers
        .get_all("connection")
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .map(|name| name.trim().to_ascii_lowercase())
        .collect();
    let mut kept = HeaderMap::new();
    for (name, value) in headers {
        let lower = name.as_str();
        if HOP_BY_HOP.contains(&lower)
            || lower == "content-length"
            || named.iter().any(|n| n == lower)
        {
            continue;
        }
        kept.append(name.clone(), value.clone());
    }
    kept
}

/// A plain-text answer of the proxy's own.
fn plain(status: StatusCode, text: String) -> Response {
    let mut response = Response::new(Body::from(text));
    *response.status_mut() = status;
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::strict_remote::StrictPayments;
    use serde_json::json;

    /// What the tests' upstream saw of one request.
    #[derive(Debug, Clone)]
    struct Seen {
        method: String,
        path_and_query: String,
        headers: HeaderMap,
        body: String,
        at: DateTime<Utc>,
    }

    /// A tiny upstream that answers 200 `{"ok": true}` at once and records
    /// what it got.
    async fn recording_upstream() -> (String, Arc<Mutex<Vec<Seen>>>) {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let record = seen.clone();
        let app = axum::Router::new().fallback(move |request: Request| {
            let record = record.clone();
            async move {
                let (parts, body) = request.into_parts();
                let body = axum::body::to_bytes(body, 1 << 20).await.expect("body");
                record.lock().unwrap().push(Seen {
                    method: parts.method.to_string(),
                    path_and_query: parts
                        .uri
                        .path_and_query()
                        .map(|pq| pq.to_string())
                        .unwrap_or_default(),
                    headers: parts.headers,
                    body: String::from_utf8_lossy(&body).into_owned(),
                    at: Utc::now(),
                });
                (
                    StatusCode::ACCEPTED,
                    [("content-type", "application/json"), ("x-upstream", "yes")],
                    r#"{"ok":true}"#,
                )
            }
        });
        let (port, _) = crate::serve_locally(app).await;
        (format!("http://127.0.0.1:{port}"), seen)
    }

    fn client(timeout: Duration) -> reqwest::Client {
        crate::install_crypto_provider();
        reqwest::Client::builder().timeout(timeout).build().unwrap()
    }

    #[tokio::test]
    async fn a_held_call_lands_after_its_client_gave_up() {
        let (upstream, seen) = recording_upstream().await;
        let proxy = HoldProxy::start(&upstream).await;
        proxy.hold("POST", "/charges", Duration::from_millis(1500));

        let sent_at = Utc::now();
        let error = client(Duration::from_millis(300))
            .post(format!("{}/charges?attempt=1", proxy.url()))
            .header("Idempotency-Key", "k-1")
            .json(&json!({"amount_cents": 250}))
            .send()
            .await
            .expect_err("the client gives up before the hold ends");
        assert!(error.is_timeout(), "{error:?}");
        let gave_up_at = Utc::now();
        assert!(
            seen.lock().unwrap().is_empty(),
            "nothing reached the upstream while the client waited"
        );

        let done = proxy.wait_forwarded(1, Duration::from_secs(10)).await;
        let passage = &done[0];
        assert_eq!(passage.method, "POST");
        assert_eq!(passage.path, "/charges");
        assert_eq!(passage.query.as_deref(), Some("attempt=1"));
        assert_eq!(passage.idempotency_key.as_deref(), Some("k-1"));
        assert_eq!(passage.held_for, Some(Duration::from_millis(1500)));
        assert_eq!(passage.status, Some(202));
        assert_eq!(passage.client_connected, Some(false), "{passage:?}");
        let forwarded_at = passage.forwarded_at.expect("forwarded");
        assert!(forwarded_at > gave_up_at, "{passage:?}");
        assert!(forwarded_at - sent_at >= chrono::Duration::milliseconds(1400));

        let seen = seen.lock().unwrap();
        assert_eq!(seen.len(), 1, "the upstream saw the call once");
        assert_eq!(seen[0].method, "POST");
        assert_eq!(seen[0].path_and_query, "/charges?attempt=1");
        assert_eq!(seen[0].body, r#"{"amount_cents":250}"#);
        assert_eq!(seen[0].headers["idempotency-key"], "k-1");
        assert!(seen[0].at > gave_up_at);
    }

    #[tokio::test]
    async fn a_late_charge_reaches_a_strict_provider() {
        let payments = StrictPayments::start(Duration::ZERO).await;
        let proxy = HoldProxy::start(&payments.url()).await;
        proxy.hold("POST", "/charges", Duration::from_millis(800));

        let error = client(Duration::from_millis(200))
            .post(format!("{}/charges", proxy.url()))
            .header("Idempotency-Key", "order-1:charge")
            .json(&json!({"amount_cents": 1999}))
            .send()
            .await
            .expect_err("the client gives up");
        assert!(error.is_timeout());
        let gave_up_at = Utc::now();
        assert!(payments.ledger().charges.is_empty());

        let done = proxy.wait_forwarded(1, Duration::from_secs(10)).await;
        assert_eq!(done[0].status, Some(201));
        assert_eq!(done[0].client_connected, Some(false));
        let charges = payments.ledger().charges;
        assert_eq!(charges.len(), 1);
        assert_eq!(charges[0].key, "order-1:charge");
        assert_eq!(charges[0].amount_cents, 1999);
        assert!(charges[0].applied_at > gave_up_at, "{charges:?}");
    }

    #[tokio::test]
    async fn other_calls_pass_at_once_with_their_headers_and_answers() {
        let (upstream, seen) = recording_upstream().await;
        let proxy = HoldProxy::start(&format!("{upstream}/")).await;
        proxy.hold("POST", "/charges", Duration::from_secs(30));
        // Methods are case-sensitive: this one holds nothing.
        proxy.hold("delete", "/charges/ch_1", Duration::from_secs(30));
        let http = client(Duration::from_secs(5));

        let started = std::time::Instant::now();
        for (method, path) in [
            ("DELETE", "/charges/ch_1"),
            ("POST", "/charges/"),
            ("POST", "/refunds"),
            ("PUT", "/charges"),
        ] {
            let answer = http
                .request(method.parse().unwrap(), format!("{}{path}", proxy.url()))
                .header("Idempotency-Key", format!("key {method} {path}"))
                .header("Authorization", "Bearer secret")
                .header(
                    "traceparent",
                    "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
                )
                .header("X-Tenant", "t-1")
                .header("Connection", "keep-alive, X-Hop")
                .header("X-Hop", "per-connection")
                .json(&json!({"n": 1}))
                .send()
                .await
                .unwrap();
            assert_eq!(answer.status().as_u16(), 202);
            assert_eq!(answer.headers()["content-type"], "application/json");
            assert_eq!(answer.headers()["x-upstream"], "yes");
            assert_eq!(answer.text().await.unwrap(), r#"{"ok":true}"#);
        }
        assert!(started.elapsed() < Duration::from_secs(5));

        let seen = seen.lock().unwrap();
        assert_eq!(seen.len(), 4);
        for request in seen.iter() {
            let headers = &request.headers;
            assert_eq!(headers["content-type"], "application/json");
            assert_eq!(headers["authorization"], "Bearer secret");
            assert_eq!(
                headers["traceparent"],
                "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
            );
            assert_eq!(headers["x-tenant"], "t-1");
            assert!(headers["idempotency-key"]
                .to_str()
                .unwrap()
                .ends_with(&request.path_and_query));
            assert!(!headers.contains_key("x-hop"), "{headers:?}");
            assert_eq!(request.body, r#"{"n":1}"#);
        }
        let journal = proxy.journal();
        assert_eq!(journal.len(), 4);
        assert!(journal.iter().all(|passage| passage.held_for.is_none()
            && passage.client_connected == Some(true)
            && passage.status == Some(202)));
    }

    #[tokio::test]
    async fn release_all_forwards_held_calls_now() {
        let (upstream, seen) = recording_upstream().await;
        let proxy = HoldProxy::start(&upstream).await;
        proxy.hold("POST", "/charges", Duration::from_secs(60));
        let url = format!("{}/charges", proxy.url());
        let waiting = tokio::spawn(async move {
            client(Duration::from_secs(10))
                .post(url)
                .json(&json!({}))
                .send()
                .await
                .map(|answer| answer.status().as_u16())
        });
        while proxy.journal().is_empty() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(seen.lock().unwrap().is_empty());

        proxy.release_all();
        assert_eq!(waiting.await.unwrap().unwrap(), 202);
        let done = proxy.wait_forwarded(1, Duration::from_secs(1)).await;
        assert_eq!(done[0].client_connected, Some(true));
        assert_eq!(seen.lock().unwrap().len(), 1);

        // Nothing is held any more.
        let started = std::time::Instant::now();
        let status = client(Duration::from_secs(5))
            .post(format!("{}/charges", proxy.url()))
            .send()
            .await
            .unwrap()
            .status();
        assert_eq!(status.as_u16(), 202);
        assert!(started.elapsed() < Duration::from_secs(5));
        assert!(proxy.journal()[1].held_for.is_none());
    }

    #[tokio::test]
    async fn an_unreachable_upstream_is_a_502_in_the_journal() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let dead = format!("http://{}", listener.local_addr().unwrap());
        drop(listener);
        let proxy = HoldProxy::start(&dead).await;
        let answer = client(Duration::from_secs(5))
            .post(format!("{}/charges", proxy.url()))
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status().as_u16(), 502);
        let journal = proxy.journal();
        assert_eq!(journal[0].status, None);
        assert!(journal[0].upstream_error.is_some());
        assert!(journal[0].done());
    }
}
