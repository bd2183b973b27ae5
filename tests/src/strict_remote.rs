//! A strict payment API stub, as a real provider behaves, for an agent whose
//! step calls `POST /charges` and whose compensation calls
//! `DELETE /charges/{id}` with the id the charge answered.
//!
//! What makes it strict, and different from remote-sim:
//!
//! - A refund names a charge by the id the provider issued, not by the
//!   idempotency key: `DELETE /charges/{id}` knows only ids it issued
//!   (404 `{"error": "no such charge"}` for any other, and for an empty id).
//!   An agent that never saw the charge's answer has no id to refund with.
//!   remote-sim undoes by key (`/{service}/{operation}` with the step's key).
//! - A charge is applied when it arrives, and answered only after
//!   `answer_after` ([`StrictPayments::set_answer_after`] changes it at run
//!   time), which may be longer than the agent's call timeout: the agent
//!   gives up on a call that was applied.
//! - The same `Idempotency-Key` while its first call is still being answered
//!   gets 409 `{"error": "in progress"}`; after that, the stored charge
//!   (200), never a second charge; with another body, 422.
//!
//! Every charge is in the ledger ([`StrictPayments::ledger`]) with when it
//! was applied and refunded, and every refusal (404, 409, ...) with its path
//! and time, so a test can show what money moved and when. It applies
//! everything on arrival, like remote-sim: a call that arrives late needs
//! [`crate::http_proxy::HoldProxy`] in front of it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{Request, State};
use axum::http::{Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use chrono::{DateTime, Utc};
use serde_json::{json, Value};

/// Largest request body the stub reads.
const MAX_BODY_BYTES: usize = 1024 * 1024;

/// A running payment API on a free port of 127.0.0.1; it stops listening
/// when dropped.
pub struct StrictPayments {
    url: String,
    shared: Arc<Shared>,
    server: tokio::task::JoinHandle<()>,
}

/// What the provider did: every charge and every refusal, in order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Ledger {
    /// Every charge applied, in the order they arrived.
    pub charges: Vec<Charge>,
    /// Every call refused (404, 409, 400, ...), in the order they arrived.
    pub refusals: Vec<Refusal>,
}

/// One charge the provider applied: the money that moved, and whether and
/// when it moved back.
#[derive(Debug, Clone, PartialEq)]
pub struct Charge {
    /// The `Idempotency-Key` it was applied under.
    pub key: String,
    /// The id the provider issued (`ch_<uuid, simple>`): the only name a
    /// refund may use.
    pub id: String,
    /// The amount charged, in cents.
    pub amount_cents: i64,
    /// The call's JSON body, as received.
    pub body: Value,
    /// When it was applied: when the call arrived.
    pub applied_at: DateTime<Utc>,
    /// When its first call was (to be) answered: `applied_at` plus the
    /// answer delay at the time.
    pub answered_at: DateTime<Utc>,
    /// How many later calls with its key got it back (200).
    pub replays: u32,
    /// When it was refunded (the first refund call; `None`: not refunded).
    pub refunded_at: Option<DateTime<Utc>>,
    /// How many refund calls named it (a repeat refunds nothing more).
    pub refund_calls: u32,
}

/// One call the provider refused: a test's evidence of a refund with a
/// wrong id, a repeat while in progress, and the like.
#[derive(Debug, Clone, PartialEq)]
pub struct Refusal {
    /// The call's method.
    pub method: String,
    /// The call's path (without the query).
    pub path: String,
    /// The call's `Idempotency-Key`, when it had one.
    pub idempotency_key: Option<String>,
    /// The status answered (404, 409, ...).
    pub status: u16,
    /// The `error` answered.
    pub error: String,
    /// When the call arrived.
    pub at: DateTime<Utc>,
}

struct Shared {
    answer_after: Mutex<Duration>,
    book: Mutex<Book>,
}

#[derive(Default)]
struct Book {
    ledger: Ledger,
    /// Per charge (same index), until when its first call is being answered.
    answering_until: Vec<Instant>,
    /// A charge's index by its idempotency key.
    by_key: HashMap<String, usize>,
}

impl Book {
    fn refuse(
        &mut self,
        method: &Method,
        path: &str,
        key: Option<&str>,
        status: StatusCode,
        error: &str,
    ) -> Response {
        self.ledger.refusals.push(Refusal {
            method: method.to_string(),
            path: path.to_owned(),
            idempotency_key: key.map(str::to_owned),
            status: status.as_u16(),
            error: error.to_owned(),
            at: Utc::now(),
        });
        (status, Json(json!({ "error": error }))).into_response()
    }
}

impl StrictPayments {
    /// Starts the provider on a free port of 127.0.0.1, answering each new
    /// charge `answer_after` after applying it.
    ///
    /// # Panics
    /// When no port can be bound.
    pub async fn start(answer_after: Duration) -> Self {
        let shared = Arc::new(Shared {
            answer_after: Mutex::new(answer_after),
            book: Mutex::new(Book::default()),
        });
        let app = axum::Router::new()
            .fallback(serve)
            .with_state(shared.clone());
        let (port, server) = crate::serve_locally(app).await;
        let url = format!("http://127.0.0.1:{port}");
        Self {
            url,
            shared,
            server,
        }
    }

    /// The provider's base URL (`http://127.0.0.1:PORT`, no trailing `/`):
    /// the agent's `remote_url`, or a [`crate::http_proxy::HoldProxy`]'s upstream.
    pub fn url(&self) -> String {
        self.url.clone()
    }

    /// Answers charges that arrive from now on `answer_after` after applying
    /// them (charges being answered keep their delay).
    pub fn set_answer_after(&self, answer_after: Duration) {
        *self.shared.answer_after.lock().expect("answer_after") = answer_after;
    }

    /// The delay new charges are answered after.
    pub fn answer_after(&self) -> Duration {
        *self.shared.answer_after.lock().expect("answer_after")
    }

    /// Every charge and refusal so far.
    pub fn ledger(&self) -> Ledger {
        self.shared.book.lock().expect("book").ledger.clone()
    }

    /// Checks that no money stayed taken: every charge was refunded, after it
    /// was applied.
    ///
    /// # Panics
    /// Naming the first charge that was not, with the whole ledger.
    pub fn assert_every_charge_refunded_after_it(&self) {
        let ledger = self.ledger();
        for charge in &ledger.charges {
            match charge.refunded_at {
                None => panic!(
                    "charge {} ({} cents, key {:?}, applied at {}) was never refunded; ledger: {ledger:#?}",
                    charge.id, charge.amount_cents, charge.key, charge.applied_at
                ),
                Some(refunded_at) if refunded_at < charge.applied_at => panic!(
                    "charge {} (key {:?}) was refunded at {refunded_at}, before it was applied at {}; ledger: {ledger:#?}",
                    charge.id, charge.key, charge.applied_at
                ),
                Some(_) => {}
            }
        }
    }
}

impl Drop for StrictPayments {
    fn drop(&mut self) {
        self.server.abort();
    }
}

/// The stub's one handler: `POST /charges`, `DELETE /charges/{id}`, and a
/// recorded 404 (or 405) for anything else.
async fn serve(State(shared): State<Arc<Shared>>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let path = parts.uri.path().to_owned();
    let key = parts
        .headers
        .get("idempotency-key")
        .and_then(|value| value.to_str().ok())
        .map(str::to_owned);
    let body = axum::body::to_bytes(body, MAX_BODY_BYTES).await;
    if path == "/charges" {
        if parts.method != Method::POST {
            return shared.book.lock().expect("book").refuse(
                &parts.method,
                &path,
                key.as_deref(),
                StatusCode::METHOD_NOT_ALLOWED,
                "method not allowed",
            );
        }
        let body = body
            .ok()
            .and_then(|bytes| serde_json::from_slice::<Value>(&bytes).ok());
        return charge(&shared, &parts.method, &path, key, body).await;
    }
    if let Some(id) = path.strip_prefix("/charges/") {
        if parts.method == Method::DELETE {
            return refund(&shared, &parts.method, &path, key.as_deref(), id);
        }
    }
    let error = if path.starts_with("/charges/") {
        "no such charge"
    } else {
        "no such route"
    };
    shared.book.lock().expect("book").refuse(
        &parts.method,
        &path,
        key.as_deref(),
        StatusCode::NOT_FOUND,
        error,
    )
}

/// The amount of a charge's body: `amount_cents`, `order.amount_cents` (the
/// agent's default payload) or `amount`, in whole cents.
fn amount_of(body: &Value) -> Option<i64> {
    body.get("amount_cents")
        .or_else(|| {
            body.get("order")
                .and_then(|order| order.get("amount_cents"))
        })
        .or_else(|| body.get("amount"))
        .and_then(Value::as_i64)
}

/// `POST /charges`: applies a new key's charge at once and answers it after
/// the delay; a known key gets 409 while its first call is answered, then
/// the stored charge.
async fn charge(
    shared: &Shared,
    method: &Method,
    path: &str,
    key: Option<String>,
    body: Option<Value>,
) -> Response {
    let answer_after = *shared.answer_after.lock().expect("answer_after");
    let (status, answer) = {
        let mut book = shared.book.lock().expect("book");
        let Some(key) = key else {
            return book.refuse(
                method,
                path,
                None,
                StatusCode::BAD_REQUEST,
                "Idempotency-Key required",
            );
        };
        let Some(body) = body else {
            return book.refuse(
                method,
                path,
                Some(&key),
                StatusCode::BAD_REQUEST,
                "the body is not JSON",
            );
        };
        if let Some(&index) = book.by_key.get(&key) {
            if book.ledger.charges[index].body != body {
                return book.refuse(
                    method,
                    path,
                    Some(&key),
                    StatusCode::UNPROCESSABLE_ENTITY,
                    "idempotency key reused with a different body",
                );
            }
            if Instant::now() < book.answering_until[index] {
                return book.refuse(
                    method,
                    path,
                    Some(&key),
                    StatusCode::CONFLICT,
                    "in progress",
                );
            }
            let charge = &mut book.ledger.charges[index];
            charge.replays += 1;
            let answer = json!({
                "id": charge.id,
                "amount_cents": charge.amount_cents,
                "refunded": charge.refunded_at.is_some(),
            });
            return (StatusCode::OK, Json(answer)).into_response();
        }
        let Some(amount_cents) = amount_of(&body) else {
            return book.refuse(
                method,
                path,
                Some(&key),
                StatusCode::BAD_REQUEST,
                "amount_cents required (a whole number of cents)",
            );
        };
        let applied_at = Utc::now();
        let id = format!("ch_{}", uuid::Uuid::new_v4().simple());
        let answered_at = applied_at
            + chrono::Duration::from_std(answer_after).expect("a delay of some years at most");
        let index = book.ledger.charges.len();
        book.ledger.charges.push(Charge {
            key: key.clone(),
            id: id.clone(),
            amount_cents,
            body,
            applied_at,
            answered_at,
            replays: 0,
            refunded_at: None,
            refund_calls: 0,
        });
        book.answering_until.push(Instant::now() + answer_after);
        book.by_key.insert(key, index);
        (
            StatusCode::CREATED,
            json!({ "id": id, "amount_cents": amount_cents }),
        )
    };
    // Applied already: a client that hangs up now leaves the charge behind.
    tokio::time::sleep(answer_after).await;
    (status, Json(answer)).into_response()
}

/// `DELETE /charges/{id}`: refunds a charge it issued (once; a repeat
/// answers the same), 404 for any other id.
fn refund(shared: &Shared, method: &Method, path: &str, key: Option<&str>, id: &str) -> Response {
    let mut book = shared.book.lock().expect("book");
    let Some(charge) = book
        .ledger
        .charges
        .iter_mut()
        .find(|charge| !id.is_empty() && charge.id == id)
    else {
        return book.refuse(method, path, key, StatusCode::NOT_FOUND, "no such charge");
    };
    charge.refund_calls += 1;
    if charge.refunded_at.is_none() {
        charge.refunded_at = Some(Utc::now());
    }
    (
        StatusCode::OK,
        Json(json!({ "id": charge.id, "refunded": true })),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn client(timeout: Duration) -> reqwest::Client {
        crate::install_crypto_provider();
        reqwest::Client::builder().timeout(timeout).build().unwrap()
    }

    async fn post_charge(
        http: &reqwest::Client,
        payments: &StrictPayments,
        key: &str,
        amount_cents: i64,
    ) -> reqwest::Result<(u16, Value)> {
        let answer = http
            .post(format!("{}/charges", payments.url()))
            .header("Idempotency-Key", key)
            .json(&json!({ "amount_cents": amount_cents, "order_id": "o-1" }))
            .send()
            .await?;
        let status = answer.status().as_u16();
        Ok((status, answer.json().await?))
    }

    async fn delete(http: &reqwest::Client, payments: &StrictPayments, path: &str) -> (u16, Value) {
        let answer = http
            .delete(format!("{}{path}", payments.url()))
            .header("Idempotency-Key", "refund-key")
            .json(&json!({}))
            .send()
            .await
            .unwrap();
        (answer.status().as_u16(), answer.json().await.unwrap())
    }

    #[tokio::test]
    async fn charges_at_once_answers_late_and_never_twice() {
        let payments = StrictPayments::start(Duration::from_secs(2)).await;
        let error = post_charge(&client(Duration::from_millis(500)), &payments, "k-1", 250)
            .await
            .expect_err("the client gives up before the answer");
        assert!(error.is_timeout());
        let gave_up_at = Utc::now();

        let charges = payments.ledger().charges;
        assert_eq!(charges.len(), 1, "applied before the client gave up");
        let charge = &charges[0];
        assert_eq!(charge.key, "k-1");
        assert_eq!(charge.amount_cents, 250);
        assert_eq!(charge.body, json!({"amount_cents": 250, "order_id": "o-1"}));
        assert!(
            charge.id.starts_with("ch_") && charge.id.len() == 35,
            "{charge:?}"
        );
        assert!(charge.applied_at < gave_up_at, "{charge:?}");
        assert!(charge.answered_at > gave_up_at, "{charge:?}");
        assert_eq!(
            charge.answered_at - charge.applied_at,
            chrono::Duration::seconds(2)
        );

        // A retry while the first call is still being answered.
        let http = client(Duration::from_secs(5));
        let (status, body) = post_charge(&http, &payments, "k-1", 250).await.unwrap();
        assert_eq!((status, body), (409, json!({"error": "in progress"})));

        // After the answer, the stored charge: no second charge.
        let left = (charge.answered_at - Utc::now())
            .to_std()
            .unwrap_or_default();
        tokio::time::sleep(left + Duration::from_millis(100)).await;
        let (status, body) = post_charge(&http, &payments, "k-1", 250).await.unwrap();
        assert_eq!(status, 200);
        assert_eq!(body["id"], charge.id);
        assert_eq!(body["amount_cents"], 250);
        // The same key with another body is refused.
        let (status, _) = post_charge(&http, &payments, "k-1", 999).await.unwrap();
        assert_eq!(status, 422);

        let ledger = payments.ledger();
        assert_eq!(ledger.charges.len(), 1);
        assert_eq!(ledger.charges[0].replays, 1);
        let statuses: Vec<u16> = ledger.refusals.iter().map(|r| r.status).collect();
        assert_eq!(statuses, [409, 422]);
        assert_eq!(ledger.refusals[0].idempotency_key.as_deref(), Some("k-1"));
    }

    #[tokio::test]
    async fn a_concurrent_call_with_the_same_key_gets_409() {
        let payments = StrictPayments::start(Duration::from_secs(2)).await;
        let http = client(Duration::from_secs(10));
        let (first, second) = tokio::join!(
            post_charge(&http, &payments, "same", 100),
            post_charge(&http, &payments, "same", 100),
        );
        let mut statuses = [first.unwrap().0, second.unwrap().0];
        statuses.sort_unstable();
        assert_eq!(statuses, [201, 409]);
        let ledger = payments.ledger();
        assert_eq!(ledger.charges.len(), 1);
        assert_eq!(ledger.refusals.len(), 1);
        assert_eq!(ledger.refusals[0].error, "in progress");
    }

    #[tokio::test]
    async fn refunds_real_ids_only() {
        let payments = StrictPayments::start(Duration::ZERO).await;
        let http = client(Duration::from_secs(5));
        let (status, body) = post_charge(&http, &payments, "k-1", 1999).await.unwrap();
        assert_eq!(status, 201);
        let id = body["id"].as_str().unwrap().to_owned();
        assert_eq!(body, json!({"id": id, "amount_cents": 1999}));

        let (status, body) = delete(&http, &payments, &format!("/charges/{id}")).await;
        assert_eq!((status, body), (200, json!({"id": id, "refunded": true})));
        let refunded_at = payments.ledger().charges[0].refunded_at.expect("refunded");
        // A repeat is answered the same and refunds nothing more.
        let (status, body) = delete(&http, &payments, &format!("/charges/{id}")).await;
        assert_eq!((status, body), (200, json!({"id": id, "refunded": true})));
        let charge = &payments.ledger().charges[0];
        assert_eq!(charge.refunded_at, Some(refunded_at));
        assert_eq!(charge.refund_calls, 2);
        payments.assert_every_charge_refunded_after_it();

        for path in ["/charges/ch_unknown", "/charges/", "/charges/k-1"] {
            let (status, body) = delete(&http, &payments, path).await;
            assert_eq!(
                (status, body),
                (404, json!({"error": "no such charge"})),
                "{path}"
            );
        }
        let refusals = payments.ledger().refusals;
        let refused: Vec<(&str, u16)> = refusals
            .iter()
            .map(|refusal| (refusal.path.as_str(), refusal.status))
            .collect();
        assert_eq!(
            refused,
            [
                ("/charges/ch_unknown", 404),
                ("/charges/", 404),
                ("/charges/k-1", 404)
            ]
        );
        assert!(refusals.iter().all(|refusal| refusal.method == "DELETE"));

        // A charge never refunded fails the check, by name.
        let (_, body) = post_charge(&http, &payments, "k-2", 5).await.unwrap();
        let kept = body["id"].as_str().unwrap().to_owned();
        let failure = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            payments.assert_every_charge_refunded_after_it();
        }))
        .expect_err("a charge is not refunded");
        let message = failure.downcast_ref::<String>().unwrap();
        assert!(message.contains(&kept), "{message}");
    }

    #[tokio::test]
    async fn the_answer_delay_changes_at_run_time_and_bad_calls_are_refused() {
        let payments = StrictPayments::start(Duration::from_secs(30)).await;
        payments.set_answer_after(Duration::ZERO);
        assert_eq!(payments.answer_after(), Duration::ZERO);
        let http = client(Duration::from_secs(5));
        let (status, _) = post_charge(&http, &payments, "k-1", 1).await.unwrap();
        assert_eq!(status, 201);

        // The agent's default payload carries the amount in the order.
        let answer = http
            .post(format!("{}/charges", payments.url()))
            .header("Idempotency-Key", "k-2")
            .json(&json!({"order": {"order_id": "o-2", "amount_cents": 42}, "results": {}}))
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status().as_u16(), 201);
        assert_eq!(payments.ledger().charges[1].amount_cents, 42);

        let without_key = http
            .post(format!("{}/charges", payments.url()))
            .json(&json!({"amount_cents": 1}))
            .send()
            .await
            .unwrap();
        assert_eq!(without_key.status().as_u16(), 400);
        let without_amount = http
            .post(format!("{}/charges", payments.url()))
            .header("Idempotency-Key", "k-3")
            .json(&json!({"note": "no amount"}))
            .send()
            .await
            .unwrap();
        assert_eq!(without_amount.status().as_u16(), 400);
        let elsewhere = http
            .post(format!("{}/refunds", payments.url()))
            .send()
            .await
            .unwrap();
        assert_eq!(elsewhere.status().as_u16(), 404);
        let statuses: Vec<u16> = payments
            .ledger()
            .refusals
            .iter()
            .map(|r| r.status)
            .collect();
        assert_eq!(statuses, [400, 400, 404]);
        assert_eq!(payments.ledger().charges.len(), 2);
    }
}
