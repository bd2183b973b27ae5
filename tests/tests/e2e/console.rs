//! The operator console's HTTP API against a real state store and broker:
//! who may read and who may act (401, 403 per role), CSRF refusals, bad
//! filters (400 naming the parameter), filters and keyset pages, and every
//! action through the JSON API changing orders through the store's
//! transitions and recorded in their history with who did it.

use std::collections::HashSet;
use std::time::Duration;

use reqwest::{Method, StatusCode};
use sas_store::ProcessState;
use sas_tests::console::{As, ConsoleClient};
use sas_tests::process::bin_dir;
use sas_tests::Setting;
use sas_tests::{order, wait_until, TestEnv};
use serde_json::{json, Value};

async fn status_and_text(response: reqwest::Response) -> (StatusCode, String) {
    let status = response.status();
    (status, response.text().await.unwrap_or_default())
}

async fn history(env: &TestEnv, order_id: &str) -> Vec<(String, String, Option<String>)> {
    env.store
        .reads()
        .history(order_id)
        .await
        .expect("history")
        .into_iter()
        .map(|h| (h.event.as_str().to_owned(), h.actor, h.detail))
        .collect()
}

/// Stores `n` orders of `customer` straight into the state store (as a
/// scheduler's intake does), ids `<prefix>-<i>`.
async fn store_orders(env: &TestEnv, prefix: &str, customer: &str, n: usize, priority: u8) {
    for i in 0..n {
        let mut submitted = order(&format!("{prefix}-{i:03}"));
        submitted.customer_id = customer.into();
        submitted.priority = Some(priority);
        env.store
            .writes()
            .insert_order(
                &submitted,
                sas_store::Plan::new("order", 1, &env.steps()),
                "0af7651916cd43dd8448eb211c80319c",
                "test",
            )
            .await
            .expect("store an order");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn reading_needs_credentials_and_acting_needs_an_operator_with_the_csrf_token() {
    let env = TestEnv::new().await;
    let (_console, console) = env.console(&[]).await;

    // Without credentials, or with wrong ones: 401 everywhere but the operations endpoints.
    for path in [
        "/",
        "/orders",
        "/orders/x",
        "/alerts",
        "/dead-letters",
        "/api/orders",
        "/api/session",
        "/live/overview",
    ] {
        for who in [As::Nobody, As::Wrong] {
            let response = console.get(path, who).await;
            assert_eq!(
                response.status(),
                StatusCode::UNAUTHORIZED,
                "{path} as {who:?}"
            );
            let challenge = response
                .headers()
                .get("www-authenticate")
                .map(|v| v.to_str().unwrap().to_owned());
            assert!(
                challenge.is_some_and(|c| c.starts_with("Basic ")),
                "{path}: a browser is asked for credentials"
            );
        }
    }
    let (_, text) = status_and_text(console.get("/api/orders", As::Nobody).await).await;
    assert!(
        text.contains("\"error\"") && text.contains("Bearer"),
        "the API says how to authenticate: {text}"
    );
    for path in ["/healthz", "/readyz", "/metrics", "/static/console.css"] {
        assert_eq!(
            console.get(path, As::Nobody).await.status(),
            StatusCode::OK,
            "{path} is open"
        );
    }

    // Both roles read, by basic auth or bearer token.
    for who in [As::Viewer, As::ViewerToken, As::Operator, As::OperatorToken] {
        for path in [
            "/",
            "/orders",
            "/alerts",
            "/dead-letters",
            "/api/orders",
            "/api/overview",
            "/api/alerts",
            "/api/dead-letters",
        ] {
            assert_eq!(
                console.get(path, who).await.status(),
                StatusCode::OK,
                "{path} as {who:?}"
            );
        }
    }

    // A viewer may not act, even with its own CSRF token.
    for who in [As::Viewer, As::ViewerToken] {
        for path in [
            "/api/orders/ord-x/resubmit",
            "/api/orders/ord-x/cancel",
            "/api/alerts/1/acknowledge",
            "/api/dead-letters/1/replay",
        ] {
            let (status, text) = status_and_text(console.act(path, who, json!({})).await).await;
            assert_eq!(status, StatusCode::FORBIDDEN, "{path} as {who:?}: {text}");
            assert!(text.contains("operator role"), "{text}");
        }
    }
    let viewer_form = console
        .request(Method::POST, "/orders/ord-x/cancel", As::Viewer)
        .form(&[("csrf_token", console.csrf(As::Viewer).await)])
        .send()
        .await
        .unwrap();
    assert_eq!(viewer_form.status(), StatusCode::FORBIDDEN);

    // An operator's action without the CSRF token, with another's, or from another origin.
    let operator_token = console.csrf(As::Operator).await;
    let viewer_token = console.csrf(As::Viewer).await;
    assert_ne!(operator_token, viewer_token, "tokens are per user");
    let path = "/api/orders/ord-nope/resubmit";
    let (status, text) = status_and_text(
        console
            .request(Method::POST, path, As::Operator)
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    assert!(text.contains("CSRF token missing"), "{text}");
    for token in [viewer_token.as_str(), "0000", ""] {
        let (status, text) = status_and_text(
            console
                .request(Method::POST, path, As::OperatorToken)
                .header("x-csrf-token", token)
                .send()
                .await
                .unwrap(),
        )
        .await;
        assert_eq!(status, StatusCode::FORBIDDEN, "token {token:?}");
        assert!(text.contains("CSRF token does not match"), "{text}");
    }
    let (status, text) = status_and_text(
        console
            .request(Method::POST, path, As::Operator)
            .header("x-csrf-token", &operator_token)
            .header("origin", "http://evil.example")
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    assert!(text.contains("evil.example"), "{text}");
    // The same request with the token passes the guard: the order does not exist.
    let (status, text) = status_and_text(
        console
            .request(Method::POST, path, As::Operator)
            .header("x-csrf-token", &operator_token)
            .header("origin", &console.base)
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{text}");
    assert!(text.contains("no order ord-nope"), "{text}");
    // A page's form carries the token in a field.
    let form = |token: Option<&str>| {
        let mut fields = vec![("reason", "test".to_owned())];
        if let Some(token) = token {
            fields.push(("csrf_token", token.to_owned()));
        }
        console
            .request(Method::POST, "/orders/ord-nope/cancel", As::Operator)
            .form(&fields)
            .send()
    };
    assert_eq!(form(None).await.unwrap().status(), StatusCode::FORBIDDEN);
    assert_eq!(
        form(Some("bad")).await.unwrap().status(),
        StatusCode::FORBIDDEN
    );
    let (status, text) = status_and_text(form(Some(&operator_token)).await.unwrap()).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{text}");
    assert!(
        text.contains("<html") && text.contains("no order ord-nope"),
        "an HTML page: {text}"
    );

    // Anonymous viewers only when configured; never anonymous operators.
    let (_open, open) = env
        .console(&[Setting::ConsoleAnonymous("viewer".to_owned())])
        .await;
    assert_eq!(
        open.get("/api/orders", As::Nobody).await.status(),
        StatusCode::OK
    );
    assert_eq!(
        open.act(path, As::Nobody, json!({})).await.status(),
        StatusCode::FORBIDDEN
    );
    for (anonymous, users) in [("none", ""), ("operator", "")] {
        let output = std::process::Command::new(bin_dir().join("console"))
            .arg("--check-config")
            .env("SAS_CONSOLE__ANONYMOUS", anonymous)
            .env("SAS_CONSOLE__USERS", users)
            .output()
            .expect("run console --check-config");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{anonymous}: {stderr}");
        assert!(
            stderr.contains("console."),
            "the message names the key: {stderr}"
        );
    }
}

fn hash_secret(secret: &str) -> Result<String, (Option<i32>, String)> {
    sas_tests::process::hash_secret("console", secret)
}

#[tokio::test(flavor = "multi_thread")]
async fn hashed_secrets_slowed_guessing_security_headers_and_a_request_timeout() {
    use sas_tests::console::{OPERATOR, VIEWER};
    // Secrets stored as their argon2id hashes (commas inside the hashes'
    // parameters and all); a short secret is not hashed.
    let (ann, bob) = (
        hash_secret(OPERATOR.1).unwrap(),
        hash_secret(VIEWER.1).unwrap(),
    );
    assert!(ann.starts_with("$argon2id$") && ann != bob, "{ann}");
    let short = hash_secret("short").unwrap_err();
    assert_eq!(short.0, Some(2), "{short:?}");
    assert!(short.1.contains("16 characters"), "{short:?}");
    let env = TestEnv::new().await;
    let (_console, console) = env
        .console(&[
            Setting::ConsoleUsers(format!(
                "{}:operator:{ann},{}:viewer:{bob}",
                OPERATOR.0, VIEWER.0
            )),
            Setting::ConsoleLoginFailuresPerMinute(3),
            Setting::ConsoleRequestTimeoutMs(1000),
        ])
        .await;
    for who in [As::Operator, As::Viewer, As::OperatorToken, As::ViewerToken] {
        let response = console.get("/api/session", who).await;
        assert_eq!(response.status(), StatusCode::OK, "{who:?}");
    }
    // Every answer, refused or not, carries the security headers.
    for who in [As::Viewer, As::Nobody] {
        let response = console.get("/orders", who).await;
        let headers = response.headers();
        let csp = headers["content-security-policy"].to_str().unwrap();
        assert!(
            csp.contains("script-src 'self'") && csp.contains("frame-ancestors 'none'"),
            "{csp}"
        );
        assert_eq!(headers["x-frame-options"], "DENY");
        assert_eq!(headers["x-content-type-options"], "nosniff");
        assert_eq!(headers["referrer-policy"], "same-origin");
    }

    // A page whose query waits (the orders locked by another transaction)
    // is answered 503 at the timeout, not left hanging.
    let mut lock = env.db.begin().await.unwrap();
    sqlx::query("LOCK TABLE orders, order_process IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *lock)
        .await
        .unwrap();
    let started = std::time::Instant::now();
    let response = tokio::time::timeout(
        Duration::from_secs(20),
        console.get("/orders/ord-locked", As::Viewer),
    )
    .await
    .expect("an answer before 20 s");
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    lock.rollback().await.unwrap();

    // Three wrong secrets in a minute: the fourth try is refused before
    // any check, even with the right secret, and says when to come back.
    for _ in 0..3 {
        assert_eq!(
            console.get("/api/session", As::Wrong).await.status(),
            StatusCode::UNAUTHORIZED
        );
    }
    let blocked = console.get("/api/session", As::Operator).await;
    assert_eq!(blocked.status(), StatusCode::TOO_MANY_REQUESTS);
    let retry: u64 = blocked.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=60).contains(&retry), "{retry}");
    let (_, text) = status_and_text(blocked).await;
    assert!(text.contains("too many failed logins"), "{text}");
    // Requests without credentials are not slowed (anonymous is off: 401).
    assert_eq!(
        console.get("/api/session", As::Nobody).await.status(),
        StatusCode::UNAUTHORIZED
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_filters_get_a_400_naming_the_parameter() {
    let env = TestEnv::new().await;
    let (_console, console) = env.console(&[]).await;
    for (query, parameter) in [
        ("state=finished", "state"),
        ("priority=10", "priority"),
        ("priority=high", "priority"),
        ("min_failures=-2", "min_failures"),
        ("from=last%20week", "from"),
        ("from=2026-11-23T10:00&to=2026-11-23T09:00", "to"),
        ("id=ord%201%27%3B", "id"),
        ("customer=%25", "customer"),
        ("step=a%20b", "step"),
        ("after=12x", "after"),
        ("limit=0", "limit"),
        ("limit=100000", "limit"),
        ("stat=error", "stat"),
    ] {
        let (status, text) = status_and_text(
            console
                .get(&format!("/api/orders?{query}"), As::Viewer)
                .await,
        )
        .await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{query}: {text}");
        let error: Value = serde_json::from_str(&text).expect("a JSON error");
        let message = error["error"].as_str().unwrap();
        assert!(
            message.contains(&format!("bad filter {parameter}=")),
            "{query}: {message}"
        );
        let (status, page) =
            status_and_text(console.get(&format!("/orders?{query}"), As::Viewer).await).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{query}");
        assert!(
            page.contains(&format!("bad filter {parameter}=")),
            "{query}: the page says it too"
        );
    }
    let (status, text) = status_and_text(
        console
            .get("/api/bulk/cancel/preview?stat=error", As::Operator)
            .await,
    )
    .await;
    assert_eq!(
        status,
        StatusCode::BAD_REQUEST,
        "a misspelt filter never selects every order: {text}"
    );
    let (status, text) =
        status_and_text(console.get("/api/bulk/explode/preview", As::Operator).await).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(text.contains("resubmit, resume or cancel"), "{text}");
}

#[tokio::test(flavor = "multi_thread")]
async fn every_filter_selects_its_orders_and_pages_cover_them_once() {
    let env = TestEnv::new().await;
    store_orders(&env, "ord-a", "cust-a", 10, 9).await;
    store_orders(&env, "ord-b", "cust-b", 20, 5).await;
    let pool = &env.db;
    // Three orders ended in error after failures, and five are a day old.
    sqlx::query("UPDATE order_process SET state = 'error', failure_count = 3, locked_by = NULL WHERE order_id IN ('ord-b-000', 'ord-b-001', 'ord-b-002')")
        .execute(pool)
        .await
        .unwrap();
    sqlx::query(
        "UPDATE steps SET state = 'completed' WHERE order_id = 'ord-a-000' AND position = 0",
    )
    .execute(pool)
    .await
    .unwrap();
    sqlx::query("UPDATE steps SET state = 'running' WHERE order_id = 'ord-a-000' AND position = 1")
        .execute(pool)
        .await
        .unwrap();
    sqlx::query("UPDATE order_process SET created_at = now() - interval '1 day' WHERE order_id LIKE 'ord-b-01%'")
        .execute(pool)
        .await
        .unwrap();
    let (_console, console) = env.console(&[]).await;
    let ids = |page: &Value| -> Vec<String> {
        page["orders"]
            .as_array()
            .unwrap()
            .iter()
            .map(|o| o["order_id"].as_str().unwrap().to_owned())
            .collect()
    };
    let get = |query: String| {
        let console = console.clone();
        async move {
            let response = console
                .get(&format!("/api/orders?{query}"), As::Viewer)
                .await;
            assert_eq!(response.status(), StatusCode::OK, "{query}");
            response.json::<Value>().await.unwrap()
        }
    };

    // Pages of 7 walk all 30 orders once, newest first.
    let mut seen = Vec::new();
    let mut after = String::new();
    loop {
        let page = get(format!("limit=7{after}")).await;
        seen.extend(ids(&page));
        match page["next"].as_str() {
            Some(next) => after = format!("&after={}", urlencode(next)),
            None => break,
        }
    }
    assert_eq!(seen.len(), 30, "{seen:?}");
    assert_eq!(
        seen.iter().collect::<HashSet<_>>().len(),
        30,
        "no order twice"
    );
    assert!(
        seen[25..].iter().all(|id| id.starts_with("ord-b-01")),
        "the day-old orders come last: {seen:?}"
    );

    let count = |page: &Value| page["orders"].as_array().unwrap().len();
    assert_eq!(count(&get("state=error".into()).await), 3);
    assert_eq!(count(&get("state=error,processing".into()).await), 30);
    assert_eq!(count(&get("customer=cust-a".into()).await), 10);
    assert_eq!(count(&get("priority=9".into()).await), 10);
    assert_eq!(count(&get("min_failures=3".into()).await), 3);
    assert_eq!(count(&get("id=ord-b-01".into()).await), 10);
    assert_eq!(ids(&get("id=ord-a-007".into()).await), vec!["ord-a-007"]);
    assert_eq!(
        ids(&get("step=charge_payment".into()).await),
        vec!["ord-a-000"]
    );
    assert_eq!(
        count(&get("step=reserve_stock".into()).await),
        29,
        "the step in flight of every order but ord-a-000"
    );
    let yesterday = (chrono::Utc::now() - chrono::Duration::hours(12)).to_rfc3339();
    assert_eq!(
        count(&get(format!("to={}", urlencode(&yesterday))).await),
        10
    );
    assert_eq!(
        count(&get(format!("from={}&customer=cust-b", urlencode(&yesterday))).await),
        10
    );
    let first = &get("id=ord-a-000".into()).await["orders"][0];
    assert_eq!(first["current_step"], "charge_payment");
    assert_eq!(first["customer_id"], "cust-a");

    // The page shows the same rows, and the preview of a bulk action counts the eligible ones.
    let (status, page) =
        status_and_text(console.get("/orders?state=error", As::Viewer).await).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(page.matches("data-order=").count(), 3, "{page}");
    let preview: Value = console
        .get("/api/bulk/resubmit/preview?customer=cust-b", As::Operator)
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(
        preview["count"], 3,
        "only the orders in error can be resubmitted: {preview}"
    );
    let preview: Value = console
        .get("/api/bulk/cancel/preview?customer=cust-b", As::Operator)
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(preview["count"], 17);
}

fn urlencode(text: &str) -> String {
    url_escape(text)
}

fn url_escape(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

async fn wait_for_states(env: &TestEnv, ids: &[String], state: ProcessState, timeout: Duration) {
    wait_until(
        &format!("{} orders {state}", ids.len()),
        timeout,
        || async {
            let mut other = Vec::new();
            for id in ids {
                let detail = env
                    .store
                    .reads()
                    .order_detail(id)
                    .await
                    .map_err(|e| e.to_string())?;
                match detail {
                    Some(d) if d.summary.state == state => {}
                    Some(d) => other.push(format!("{id}: {}", d.summary.state)),
                    None => other.push(format!("{id}: missing")),
                }
            }
            if other.is_empty() {
                Ok(())
            } else {
                Err(other.join(", "))
            }
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn actions_through_the_json_api_go_through_the_store_and_are_recorded_with_who_did_them() {
    let env = TestEnv::new().await;
    let (_connection, publisher) = env.broker().await;
    // A scheduler and a supervisor but no agent yet: the orders stay in flight.
    let _scheduler = env.scheduler(0, &[]);
    let _supervisor = env.supervisor(0, &[]);
    let (_console, console): (_, ConsoleClient) = env.console(&[]).await;
    let bulk: Vec<String> = (0..6).map(|i| format!("ord-bulk-{i}")).collect();
    for id in bulk.iter().chain(std::iter::once(&"ord-one".to_owned())) {
        let mut submitted = order(id);
        submitted.customer_id = if id == "ord-one" {
            "cust-one".into()
        } else {
            "cust-bulk".into()
        };
        env.publish_order(&publisher, &submitted).await;
    }
    let mut all = bulk.clone();
    all.push("ord-one".into());
    wait_for_states(
        &env,
        &all,
        ProcessState::Processing,
        Duration::from_secs(20),
    )
    .await;

    // Cancel one.
    let (status, text) = status_and_text(
        console
            .act(
                "/api/orders/ord-one/cancel",
                As::Operator,
                json!({"reason": "customer called"}),
            )
            .await,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let lines = history(&env, "ord-one").await;
    assert!(
        lines
            .iter()
            .any(|(event, actor, detail)| event == "cancelled"
                && actor == "console:ann"
                && detail
                    .as_deref()
                    .is_some_and(|d| d.contains("customer called"))),
        "{lines:?}"
    );
    let (status, text) = status_and_text(
        console
            .act("/api/orders/ord-one/cancel", As::Operator, json!({}))
            .await,
    )
    .await;
    assert_eq!(
        status,
        StatusCode::CONFLICT,
        "a cancelled order is not cancelled twice: {text}"
    );
    let (status, _) = status_and_text(
        console
            .act(
                "/api/orders/ord-one/cancel",
                As::Operator,
                json!({"why": 1}),
            )
            .await,
    )
    .await;
    assert_eq!(
        status,
        StatusCode::BAD_REQUEST,
        "unknown fields are refused"
    );

    // Bulk cancel: preview, a stale confirmation, then the confirmed one.
    let preview: Value = console
        .get("/api/bulk/cancel/preview?customer=cust-bulk", As::Operator)
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(preview["count"], 6, "{preview}");
    let (status, text) = status_and_text(
        console
            .act(
                "/api/bulk/cancel?customer=cust-bulk",
                As::Operator,
                json!({"confirmed": 5}),
            )
            .await,
    )
    .await;
    assert_eq!(
        status,
        StatusCode::CONFLICT,
        "more orders match than were confirmed: {text}"
    );
    assert!(text.contains("preview again"), "{text}");
    let (status, text) = status_and_text(
        console
            .act(
                "/api/bulk/cancel?customer=cust-bulk",
                As::Operator,
                json!({}),
            )
            .await,
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "no confirmation: {text}");
    for id in &bulk {
        assert_eq!(
            env.detail(id).await.summary.state,
            ProcessState::Processing,
            "nothing was done without the confirmation"
        );
    }
    let outcome: Value = console
        .act(
            "/api/bulk/cancel?customer=cust-bulk",
            As::Operator,
            json!({"confirmed": 6}),
        )
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(outcome["applied"].as_array().unwrap().len(), 6, "{outcome}");
    for id in &bulk {
        let lines = history(&env, id).await;
        assert!(
            lines
                .iter()
                .any(|(event, actor, _)| event == "cancelled" && actor == "console:ann"),
            "{id}: {lines:?}"
        );
    }

    // With agents, every cancelled order is undone.
    let (_sim_process, sim) = env.remote_sim(&[]).await;
    let _agents = env.agents(1, &sim, &[]);
    wait_for_states(
        &env,
        &all,
        ProcessState::Compensated,
        Duration::from_secs(60),
    )
    .await;

    // Resubmit one; then the rest by filter.
    let (status, text) = status_and_text(
        console
            .act("/api/orders/ord-one/resubmit", As::OperatorToken, json!({}))
            .await,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{text}");
    assert!(text.contains("workflow restarted"), "{text}");
    wait_for_states(
        &env,
        &["ord-one".to_owned()],
        ProcessState::Processed,
        Duration::from_secs(30),
    )
    .await;
    let (status, _) = status_and_text(
        console
            .act("/api/orders/ord-one/resubmit", As::Operator, json!({}))
            .await,
    )
    .await;
    assert_eq!(
        status,
        StatusCode::CONFLICT,
        "a processed order is not resubmitted"
    );
    let lines = history(&env, "ord-one").await;
    assert!(
        lines
            .iter()
            .any(|(event, actor, _)| event == "resubmitted" && actor == "console:ann"),
        "{lines:?}"
    );
    let preview: Value = console
        .get(
            "/api/bulk/resubmit/preview?customer=cust-bulk",
            As::Operator,
        )
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(preview["count"], 6);
    let outcome: Value = console
        .act(
            "/api/bulk/resubmit?customer=cust-bulk",
            As::Operator,
            json!({"confirmed": 6}),
        )
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(outcome["applied"].as_array().unwrap().len(), 6, "{outcome}");
    wait_for_states(
        &env,
        &bulk,
        ProcessState::Processed,
        Duration::from_secs(60),
    )
    .await;

    // Alerts: acknowledge, then resolve with a note.
    let alert: i64 = sqlx::query_scalar("INSERT INTO alerts (order_id, kind, message) VALUES ('ord-one', 'compensation_failed', 'test alert') RETURNING id")
        .fetch_one(&env.db)
        .await
        .unwrap();
    let ack = format!("/api/alerts/{alert}/acknowledge");
    let resolve = format!("/api/alerts/{alert}/resolve");
    assert_eq!(
        console.act(&ack, As::Operator, json!({})).await.status(),
        StatusCode::OK
    );
    assert_eq!(
        console
            .act(&resolve, As::Operator, json!({}))
            .await
            .status(),
        StatusCode::BAD_REQUEST,
        "a resolution needs a note"
    );
    assert_eq!(
        console
            .act(
                &resolve,
                As::Operator,
                json!({"note": "refund done by hand"})
            )
            .await
            .status(),
        StatusCode::OK
    );
    assert_eq!(
        console
            .act(&resolve, As::Operator, json!({"note": "again"}))
            .await
            .status(),
        StatusCode::CONFLICT
    );
    assert_eq!(
        console
            .act("/api/alerts/999999/acknowledge", As::Operator, json!({}))
            .await
            .status(),
        StatusCode::NOT_FOUND
    );
    let alerts: Value = console
        .get("/api/alerts?all=true", As::Viewer)
        .await
        .json()
        .await
        .unwrap();
    let row = alerts
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["id"] == alert)
        .unwrap()
        .clone();
    assert_eq!(row["acknowledged_by"], "console:ann", "{row}");
    assert_eq!(row["resolved_by"], "console:ann");
    assert_eq!(row["resolution_note"], "refund done by hand");
    let lines = history(&env, "ord-one").await;
    for event in ["alert_acknowledged", "alert_resolved"] {
        assert!(
            lines
                .iter()
                .any(|(e, actor, _)| e == event && actor == "console:ann"),
            "{event}: {lines:?}"
        );
    }

    // Dead letters: replay one to its queue (the order then runs), discard another.
    let mut replayed = order("ord-replayed");
    replayed.customer_id = "cust-dl".into();
    let body = serde_json::to_string(&replayed).unwrap();
    let orders_queue = env.amqp().names().orders();
    let replay_id: i64 = sqlx::query_scalar("INSERT INTO dead_letters (source_queue, reason, order_id, body) VALUES ($1, 'delivery_limit', 'ord-replayed', $2) RETURNING id")
        .bind(&orders_queue)
        .bind(&body)
        .fetch_one(&env.db)
        .await
        .unwrap();
    let unknown_id: i64 = sqlx::query_scalar("INSERT INTO dead_letters (source_queue, reason, body) VALUES (NULL, 'untrusted dead letter', '{}') RETURNING id")
        .fetch_one(&env.db)
        .await
        .unwrap();
    let (status, text) = status_and_text(
        console
            .act(
                &format!("/api/dead-letters/{replay_id}/replay"),
                As::Operator,
                json!({}),
            )
            .await,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{text}");
    wait_for_states(
        &env,
        &["ord-replayed".to_owned()],
        ProcessState::Processed,
        Duration::from_secs(30),
    )
    .await;
    assert_eq!(
        console
            .act(
                &format!("/api/dead-letters/{replay_id}/replay"),
                As::Operator,
                json!({})
            )
            .await
            .status(),
        StatusCode::CONFLICT,
        "replayed once"
    );
    let (status, text) = status_and_text(
        console
            .act(
                &format!("/api/dead-letters/{unknown_id}/replay"),
                As::Operator,
                json!({}),
            )
            .await,
    )
    .await;
    assert_eq!(status, StatusCode::CONFLICT, "{text}");
    assert!(text.contains("discard"), "says what to do: {text}");
    assert_eq!(
        console
            .act(
                &format!("/api/dead-letters/{unknown_id}/discard"),
                As::Operator,
                json!({})
            )
            .await
            .status(),
        StatusCode::OK
    );
    assert_eq!(
        console
            .act(
                &format!("/api/dead-letters/{unknown_id}/discard"),
                As::Operator,
                json!({})
            )
            .await
            .status(),
        StatusCode::CONFLICT
    );
    let letters: Value = console
        .get("/api/dead-letters", As::Viewer)
        .await
        .json()
        .await
        .unwrap();
    let disposition = |id: i64| sas_tests::disposition_of(&letters, id);
    assert_eq!(disposition(replay_id), "replayed");
    assert_eq!(disposition(unknown_id), "discarded");
    let lines = history(&env, "ord-replayed").await;
    assert!(
        lines
            .iter()
            .any(|(e, actor, _)| e == "dead_letter_replayed" && actor == "console:ann"),
        "{lines:?}"
    );

    // The overview counts what happened.
    let overview: Value = console
        .get("/api/overview", As::Viewer)
        .await
        .json()
        .await
        .unwrap();
    let by_state = overview["activity"]["by_state"].as_array().unwrap();
    assert!(
        by_state
            .iter()
            .any(|pair| pair[0] == "processed" && pair[1] == 8),
        "{overview}"
    );
    // The agents' lines, where admission control keeps the real backlog.
    let lines = overview["admission"].as_array().unwrap();
    for agent in ["inventory", "payment", "shipping"] {
        let line = lines
            .iter()
            .find(|l| l["agent"] == agent)
            .unwrap_or_else(|| panic!("no line for {agent}: {overview}"));
        assert!(
            line["waiting"].as_i64().unwrap() >= 0 && line["admit_limit"].as_i64().unwrap() >= 1,
            "{line}"
        );
    }
    let queues = overview["queues"].as_array().unwrap();
    let orders = queues
        .iter()
        .find(|q| q["queue"] == orders_queue.as_str())
        .unwrap();
    assert!(
        orders["consumers"].as_u64().unwrap() >= 1,
        "the scheduler consumes the orders: {orders}"
    );
}

/// Reads server-sent events from `response` until one's data contains
/// `needle`, and returns that event's data.
async fn event_containing(
    response: &mut reqwest::Response,
    needle: &str,
    timeout: Duration,
) -> String {
    let deadline = tokio::time::Instant::now() + timeout;
    let mut buffer = String::new();
    loop {
        while let Some(end) = buffer.find("\n\n") {
            let frame: String = buffer.drain(..end + 2).collect();
            let data: Vec<&str> = frame
                .lines()
                .filter_map(|line| line.strip_prefix("data:"))
                .map(|d| d.strip_prefix(' ').unwrap_or(d))
                .collect();
            let data = data.join("\n");
            if data.contains(needle) {
                return data;
            }
        }
        let chunk = tokio::time::timeout_at(deadline, response.chunk())
            .await
            .unwrap_or_else(|_| panic!("no event containing {needle:?} within {timeout:?}"))
            .expect("the stream stays open")
            .expect("the stream has not ended");
        buffer.push_str(&String::from_utf8_lossy(&chunk));
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn the_overview_and_an_order_page_are_sent_again_when_they_change() {
    let env = TestEnv::new().await;
    store_orders(&env, "ord-live", "cust-live", 2, 5).await;
    let (_console, console) = env.console(&[]).await;
    let mut order = console.get("/live/orders/ord-live-000", As::Viewer).await;
    assert_eq!(order.status(), StatusCode::OK);
    assert!(order.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let mut overview = console.get("/live/overview", As::Viewer).await;
    let first = event_containing(
        &mut overview,
        "data-state=\"processing\"",
        Duration::from_secs(10),
    )
    .await;
    assert!(first.contains("data-state=\"processing\">2<"), "{first}");
    event_containing(
        &mut order,
        "data-state=\"processing\"",
        Duration::from_secs(10),
    )
    .await;

    // The order ends in error: both streams send their part again.
    sqlx::query("UPDATE order_process SET state = 'error', locked_by = NULL, updated_at = now() WHERE order_id = 'ord-live-000'")
        .execute(&env.db)
        .await
        .unwrap();
    event_containing(&mut order, "data-state=\"error\"", Duration::from_secs(10)).await;
    let changed = event_containing(
        &mut overview,
        "data-state=\"error\">1<",
        Duration::from_secs(10),
    )
    .await;
    assert!(
        changed.contains("data-state=\"processing\">1<"),
        "{changed}"
    );
    // The stream of an order that does not exist ends at once.
    let mut missing = console.get("/live/orders/ord-nope", As::Viewer).await;
    let ended = tokio::time::timeout(Duration::from_secs(10), missing.chunk()).await;
    assert!(matches!(ended, Ok(Ok(None))), "the stream ends: {ended:?}");
    // The pages hold the part the streams replace, and the script that does it.
    let (_, page) = status_and_text(console.get("/orders/ord-live-000", As::Viewer).await).await;
    assert!(
        page.contains("id=\"live\"")
            && page.contains("src=\"/static/live.js\" data-live=\"/live/orders/ord-live-000\""),
        "{page}"
    );
}

/// The console benchmark's quick mode runs with the tests, so that it cannot
/// rot: it asserts that every page answered with rows and sane times, not
/// that they are fast.
#[test]
fn the_quick_console_benchmark_runs_and_reports_sane_figures() {
    // sas-console-bench makes its own env, in its own process, on the
    // servers the other tests share.
    let _servers = sas_tests::ServerGuard::shared_blocking();
    let out = std::env::temp_dir().join(format!("sas-console-bench-{}.json", std::process::id()));
    let status = std::process::Command::new(bin_dir().join("sas-console-bench"))
        .args(["--quick", "--out"])
        .arg(&out)
        .status()
        .expect("run sas-console-bench (cargo build --workspace --bins builds it)");
    assert!(status.success());
    let report: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    let _ = std::fs::remove_file(&out);
    let pages = report.as_array().expect("one entry per page");
    assert_eq!(pages.len(), 10, "{report}");
    for page in pages {
        let (p50, p99) = (
            page["p50_ms"].as_f64().unwrap(),
            page["p99_ms"].as_f64().unwrap(),
        );
        assert!(0.0 < p50 && p50 <= p99 && p99 < 10_000.0, "{page}");
        assert!(
            page["rows"].as_u64().unwrap() > 0,
            "every page finds orders: {page}"
        );
    }
}

/// Why the store refuses to replay a dead letter from `source_queue`.
async fn replay_refusal(
    env: &TestEnv,
    source_queue: &str,
) -> (i64, sas_store::reads::dead_letters::NotReplayable) {
    let id: i64 = sqlx::query_scalar(
        "INSERT INTO dead_letters (source_queue, reason, body) VALUES ($1, 'delivery_limit', '{}') RETURNING id",
    )
    .bind(source_queue)
    .fetch_one(&env.db)
    .await
    .unwrap();
    let refusal = env
        .store
        .reads()
        .replay_of(id, &env.amqp().names())
        .await
        .unwrap()
        .unwrap_err();
    assert!(refusal.to_string().contains("discard it"), "{refusal}");
    (id, refusal)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_dead_lettered_reply_is_not_replayed_because_only_agents_may_send_replies() {
    let env = TestEnv::new().await;
    let (id, refusal) = replay_refusal(&env, &env.amqp().names().scheduler_replies()).await;
    assert_eq!(
        refusal,
        sas_store::reads::dead_letters::NotReplayable::AgentReply(id)
    );
}

/// A dead-lettered step request is not replayed: the supervisor took its
/// step over when it was dead-lettered, and a replay could land the call
/// after the order's undo.
#[tokio::test(flavor = "multi_thread")]
async fn a_dead_lettered_step_request_is_not_replayed_because_its_order_moved_on() {
    let env = TestEnv::new().await;
    let queue = env.amqp().names().agent_requests("payment");
    let (id, refusal) = replay_refusal(&env, &queue).await;
    assert_eq!(
        refusal,
        sas_store::reads::dead_letters::NotReplayable::StepRequest(id)
    );
}
