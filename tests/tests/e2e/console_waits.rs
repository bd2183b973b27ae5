//! The console's button and API action for an order parked at a wait step,
//! against real processes running the shipped `large_order` workflow: the
//! order page says what the order waits for and until when; an operator
//! sends the event (`POST /api/orders/ID/signal`, or the button in a real
//! browser), and the order runs on to `processed` with `{"by": <user>}` as
//! the wait's result and its history naming the event's id. An event the
//! order does not wait for, an order that waits for nothing and no order
//! are refused (409, 409, 404), and send nothing.
//!
//! The Workflows page and its move, on orders parked at a wait under
//! version 1 of a workflow when a scheduler restarted on version 2
//! registers it: `GET /api/workflows` and the page list both versions with
//! their orders by state; `POST /api/workflows/move` looks, then moves the
//! confirmed number (refused when more would move, or the version is
//! unknown, or the caller a viewer); an unsafe move leaves every order as
//! it is, with why; the page's look and its "Move N orders" button in a
//! real browser, and an order parked between the two refused as a whole.

use std::time::Duration;

use reqwest::StatusCode;
use sas_store::ProcessState;
use sas_tests::browser::Browser;
use sas_tests::console::{As, ConsoleClient, OPERATOR};
use sas_tests::process::Service;
use sas_tests::{order, repo_root, wait_until, Setting, TestEnv};

use super::waits::{assert_moved_to_version_2, wait_for_approval, MOVED_1_TO_2};
use serde_json::{json, Value};

/// The settings that make a scheduler read the shipped `workflows/` folder.
fn shipped_workflows() -> [Setting; 2] {
    [
        Setting::SchedulerWorkflowFile(String::new()),
        Setting::SchedulerWorkflowDir(repo_root().join("workflows").display().to_string()),
    ]
}

/// A running system on the shipped workflows, with the console; the
/// processes stop when the returned services are dropped.
async fn system(env: &TestEnv) -> (Vec<Service>, ConsoleClient) {
    let (sim_process, sim) = env.remote_sim(&[]).await;
    let mut services = env.agents(1, &sim, &[]);
    services.push(sim_process);
    // The console's broker user (guest here) sends events on its
    // operators' behalf: the scheduler believes its sender header.
    let mut scheduler = shipped_workflows().to_vec();
    scheduler.push(Setting::AmqpDelegatingUsers("guest".into()));
    services.push(env.scheduler(0, &scheduler));
    services.push(env.supervisor(0, &[]));
    let (console_process, console) = env.console(&[]).await;
    services.push(console_process);
    (services, console)
}

/// Submits a `large_order` order `order_id` and waits until it is parked
/// at its approval.
async fn parked_large_order(env: &TestEnv, publisher: &sas_broker::Publisher, order_id: &str) {
    let mut submitted = order(order_id);
    submitted.workflow = Some("large_order".into());
    env.publish_order(publisher, &submitted).await;
    wait_for_approval(env, order_id).await;
}

/// The events in an order's mailbox: (event id, name, used by which step).
async fn mailbox(env: &TestEnv, order_id: &str) -> Vec<(String, String, Option<String>)> {
    sqlx::query_as(
        "SELECT event_id, name, used_by FROM order_events WHERE order_id = $1 ORDER BY received_at",
    )
    .bind(order_id)
    .fetch_all(&env.db)
    .await
    .unwrap()
}

/// The approval step's result, the detail of its `wait_ended` line, and
/// whether any history line was written by the console.
async fn approval_outcome(env: &TestEnv, order_id: &str) -> (Option<Value>, String, bool) {
    let detail = env.detail(order_id).await;
    let result = detail
        .steps
        .iter()
        .find(|s| s.name == "approval")
        .and_then(|s| s.result.clone());
    let ended = detail
        .history
        .iter()
        .find(|h| h.event.as_str() == "wait_ended")
        .and_then(|h| h.detail.clone())
        .unwrap_or_default();
    let by_console = detail
        .history
        .iter()
        .any(|h| h.actor.starts_with("console:"));
    (result, ended, by_console)
}

async fn status_and_json(response: reqwest::Response) -> (StatusCode, Value) {
    let status = response.status();
    let text = response.text().await.unwrap_or_default();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn the_api_sends_the_event_an_order_waits_for_and_refuses_any_other() {
    let env = TestEnv::new().await;
    let (_services, console) = system(&env).await;
    let (_connection, publisher) = env.broker().await;
    parked_large_order(&env, &publisher, "big-1").await;

    // The order's answer says what it waits for, and until when.
    let (status, detail) =
        status_and_json(console.get("/api/orders/big-1", As::Viewer).await).await;
    assert_eq!(status, StatusCode::OK, "{detail}");
    let waiting = &detail["waiting"];
    assert_eq!(waiting["step"], "approval", "{detail}");
    assert_eq!(waiting["event"], "approved", "{detail}");
    assert_eq!(waiting["on_timeout"], "compensate", "{detail}");
    let until = waiting["until"].as_str().unwrap_or_default();
    let until = chrono::DateTime::parse_from_rfc3339(until)
        .unwrap_or_else(|e| panic!("until {until:?}: {e}"));
    let left = until.with_timezone(&chrono::Utc) - chrono::Utc::now();
    assert!(
        left > chrono::Duration::minutes(55) && left <= chrono::Duration::minutes(60),
        "the approval times out an hour after the wait began: {left}"
    );
    // The page shows it to both roles; only an operator gets the button.
    for (who, button) in [(As::Viewer, false), (As::Operator, true)] {
        let page = console
            .get("/orders/big-1", who)
            .await
            .text()
            .await
            .unwrap();
        assert!(
            page.contains("id=\"waiting\"") && page.contains("approved"),
            "{page}"
        );
        assert_eq!(page.contains("id=\"send-event\""), button, "{who:?}");
    }

    // Refused: a viewer; a malformed request; an event it does not wait
    // for; an order that waits for nothing; no order.
    let signal = |path: &str, who: As, body: Value| {
        let console = console.clone();
        let path = path.to_owned();
        async move { status_and_json(console.act(&path, who, body).await).await }
    };
    let (status, answer) = signal(
        "/api/orders/big-1/signal",
        As::Viewer,
        json!({"event": "approved"}),
    )
    .await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{answer}");
    for body in [
        json!({}),
        json!({"event": "no way"}),
        json!({"name": "approved"}),
    ] {
        let (status, answer) = signal("/api/orders/big-1/signal", As::Operator, body.clone()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {answer}");
    }
    let (status, answer) = signal(
        "/api/orders/big-1/signal",
        As::Operator,
        json!({"event": "rejected"}),
    )
    .await;
    assert_eq!(status, StatusCode::CONFLICT, "{answer}");
    let error = answer["error"].as_str().unwrap_or_default();
    assert_eq!(
        error, "order big-1 waits for approved, not for rejected: nothing was sent",
        "{error}"
    );
    env.publish_order(&publisher, &order("plain-1")).await;
    env.wait_for_state("plain-1", ProcessState::Processed, Duration::from_secs(30))
        .await;
    let (status, answer) = signal(
        "/api/orders/plain-1/signal",
        As::Operator,
        json!({"event": "approved"}),
    )
    .await;
    assert_eq!(status, StatusCode::CONFLICT, "{answer}");
    assert!(
        answer["error"]
            .as_str()
            .is_some_and(|e| e.contains("is processed and waits for no event")),
        "{answer}"
    );
    let (status, answer) = signal(
        "/api/orders/nope-1/signal",
        As::Operator,
        json!({"event": "approved"}),
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{answer}");
    assert_eq!(answer["error"], "no order nope-1", "{answer}");
    assert!(
        mailbox(&env, "big-1").await.is_empty(),
        "nothing refused was sent"
    );
    assert_eq!(
        env.state_of("big-1").await,
        Some(ProcessState::Pending),
        "the order still waits"
    );

    // The operator approves: the order runs on, the approval's result
    // says who, and the history names the event.
    let (status, answer) = signal(
        "/api/orders/big-1/signal",
        As::Operator,
        json!({"event": "approved"}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    let event_id = answer["event_id"].as_str().unwrap_or_default().to_owned();
    let uuid = event_id.strip_prefix("console-").unwrap_or_default();
    assert_eq!(
        uuid::Uuid::parse_str(uuid).map(|u| u.get_version_num()),
        Ok(7),
        "console-<uuid v7>: {answer}"
    );
    let message = answer["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("approved") && message.contains(&event_id),
        "{message}"
    );
    env.wait_for_state("big-1", ProcessState::Processed, Duration::from_secs(30))
        .await;
    let (result, ended, by_console) = approval_outcome(&env, "big-1").await;
    assert_eq!(result, Some(json!({"by": OPERATOR.0})));
    assert_eq!(
        ended,
        format!("event approved ({event_id}) from console:{}", OPERATOR.0),
        "the history names the operator"
    );
    assert!(!by_console, "the console records nothing itself");
    assert_eq!(
        mailbox(&env, "big-1").await,
        [(
            event_id.clone(),
            "approved".to_owned(),
            Some("approval".to_owned())
        )]
    );

    // Once used, the same event is refused: the order waits for nothing.
    let (status, answer) = signal(
        "/api/orders/big-1/signal",
        As::Operator,
        json!({"event": "approved"}),
    )
    .await;
    assert_eq!(status, StatusCode::CONFLICT, "{answer}");
    let (_, detail) = status_and_json(console.get("/api/orders/big-1", As::Viewer).await).await;
    assert_eq!(detail["waiting"], Value::Null, "{detail}");
}

#[tokio::test(flavor = "multi_thread")]
async fn an_operator_approves_a_waiting_order_with_the_button_in_a_browser() {
    let env = TestEnv::new().await;
    let (_services, console) = system(&env).await;
    let (_connection, publisher) = env.broker().await;
    parked_large_order(&env, &publisher, "big-web-1").await;

    let browser = Browser::start(&env.id).await;
    let base = console
        .base
        .replace("http://", &format!("http://{}:{}@", OPERATOR.0, OPERATOR.1));
    browser.goto(&format!("{base}/orders/big-web-1")).await;
    assert_eq!(browser.text("#waiting-event").await, "approved");
    let until = browser.text("#waiting-until").await;
    assert!(until.starts_with("20"), "a time: {until}");
    let waiting = browser.text("#waiting").await;
    assert!(
        waiting.contains("approval") && waiting.contains("undone"),
        "{waiting}"
    );
    let button = browser.text("#send-event").await;
    assert_eq!(button, "Send approved");
    assert_eq!(
        env.state_of("big-web-1").await,
        Some(ProcessState::Pending),
        "parked until the button is clicked"
    );
    browser.screenshot("01-order-waiting-for-approval").await;

    browser.click("#send-event").await;
    let notice = browser.text(".notice").await;
    assert!(
        notice.contains("event approved sent to order big-web-1 (console-"),
        "{notice}"
    );
    browser
        .wait_for_attribute(
            "#order-state",
            "data-state",
            "processed",
            Duration::from_secs(30),
        )
        .await;
    assert_eq!(browser.count("#send-event").await, 0, "no button once done");
    let approval = browser.text("#steps tr[data-step='approval']").await;
    assert!(approval.contains("\"by\": \"ann\""), "{approval}");
    let history = browser.text("#history").await;
    assert!(
        history.contains("wait_ended") && history.contains("event approved (console-"),
        "{history}"
    );
    browser.screenshot("02-order-approved-processed").await;
    browser.close().await;

    let (result, ended, by_console) = approval_outcome(&env, "big-web-1").await;
    assert_eq!(result, Some(json!({"by": OPERATOR.0})));
    assert!(
        notice.contains(
            ended
                .trim_start_matches("event approved (")
                .split(')')
                .next()
                .unwrap_or_default()
        ),
        "the history names the event the notice named: {ended} / {notice}"
    );
    assert!(!by_console, "the console records nothing itself");
    assert_eq!(
        env.state_of("big-web-1").await,
        Some(ProcessState::Processed)
    );
}

/// Version 1: a charge, a ten-minute cooling-off, then shipping.
fn version_1(env: &TestEnv) -> String {
    let timeout = env.step_timeout_ms;
    super::waits::order_version(
        env,
        1,
        60_000,
        &format!(
            r#"
[[steps]]
name = "charge_payment"
agent = "payment"
action = "charge"
compensation = "refund"
timeout_ms = {timeout}

[[steps]]
name = "cooling_off"
kind = "delay"
delay_ms = 600000

[[steps]]
name = "create_shipment"
agent = "shipping"
action = "ship"
compensation = "cancel"
timeout_ms = {timeout}
"#
        ),
    )
}

/// `GET /api/workflows` as a viewer.
async fn workflows(console: &ConsoleClient) -> Vec<Value> {
    let (status, list) = status_and_json(console.get("/api/workflows", As::Viewer).await).await;
    assert_eq!(status, StatusCode::OK, "{list}");
    list.as_array().cloned().unwrap_or_default()
}

/// The entry of version `version` of `order` in `GET /api/workflows`.
fn order_at(list: &[Value], version: i32) -> Option<&Value> {
    list.iter()
        .find(|w| w["workflow"] == "order" && w["version"] == version)
}

/// A running system and its console, whose scheduler ran version 1 of
/// `order` while `ids` were submitted (each parked at its approval), then
/// was restarted on version 2, which is registered once this returns. The
/// processes stop when the returned services are dropped.
async fn parked_under_version_1(
    env: &TestEnv,
    publisher: &sas_broker::Publisher,
    ids: &[&str],
) -> (Vec<Service>, sas_tests::sim::SimClient, ConsoleClient) {
    let settings = env.workflows(&[("order.toml", &version_1(env))]);
    let (sim_process, sim) = env.remote_sim(&[]).await;
    let mut services = env.agents(1, &sim, &[]);
    services.push(sim_process);
    let mut first = env.scheduler(0, &settings);
    services.push(env.supervisor(0, &[]));
    let (console_process, console) = env.console(&[]).await;
    services.push(console_process);
    for id in ids {
        env.publish_order(publisher, &order(id)).await;
    }
    for id in ids {
        wait_for_approval(env, id).await;
    }
    // The new file is deployed: a scheduler restarted on it registers it.
    env.workflows(&[("order.toml", &super::waits::version_2(env))]);
    first.terminate(Duration::from_secs(20)).await;
    services.push(env.scheduler(1, &settings));
    wait_until(
        "version 2 of order to be registered",
        Duration::from_secs(20),
        || async {
            let list = workflows(&console).await;
            order_at(&list, 2)
                .filter(|v| v["registered_at"].is_string())
                .map(|_| ())
                .ok_or_else(|| format!("{list:?}"))
        },
    )
    .await;
    (services, sim, console)
}

/// The steps of a `GET /api/workflows` entry: (name, kind, what it does).
fn steps_of(version: &Value) -> Vec<(String, String, String)> {
    version["steps"]
        .as_array()
        .map(|steps| {
            steps
                .iter()
                .map(|s| {
                    let text = |field: &str| s[field].as_str().unwrap_or_default().to_owned();
                    (text("name"), text("kind"), text("does"))
                })
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread")]
async fn the_api_looks_then_moves_parked_orders_to_a_new_version_and_an_unsafe_move_moves_none() {
    let env = TestEnv::new().await;
    let (_connection, publisher) = env.broker().await;
    let ids = ["move-0", "move-1", "move-2"];
    let (_services, sim, console) = parked_under_version_1(&env, &publisher, &ids).await;

    // The list: both versions, their steps, and the orders of each by state.
    let list = workflows(&console).await;
    let v1 = order_at(&list, 1).expect("version 1 listed");
    let v2 = order_at(&list, 2).expect("version 2 listed");
    assert_eq!(
        v1["orders"],
        json!({"waiting": 3, "running": 0, "ended": 0}),
        "{v1}"
    );
    assert_eq!(
        v2["orders"],
        json!({"waiting": 0, "running": 0, "ended": 0}),
        "{v2}"
    );
    let step = |name: &str, kind: &str, does: &str| (name.into(), kind.into(), does.into());
    assert_eq!(
        steps_of(v1),
        [
            step("reserve_stock", "call", "call inventory.reserve"),
            step("approval", "wait", "wait for approved"),
            step("charge_payment", "call", "call payment.charge"),
            step("cooling_off", "delay", "delay 600 s"),
            step("create_shipment", "call", "call shipping.ship"),
        ]
    );
    assert_eq!(
        steps_of(v2),
        [
            step("reserve_stock", "call", "call inventory.reserve"),
            step("approval", "wait", "wait for approved"),
            step("charge", "call", "call payment.charge"),
            step("create_shipment", "call", "call shipping.ship"),
        ]
    );
    assert!(v1["registered_at"].is_string(), "{v1}");
    assert_eq!(v1["steps"][0]["compensation"], "release", "{v1}");
    assert_eq!(v1["steps"][1]["event"], "approved", "{v1}");
    assert_eq!(v1["steps"][1]["on_timeout"], "compensate", "{v1}");

    let post = |who: As, body: Value| {
        let console = console.clone();
        async move { status_and_json(console.act("/api/workflows/move", who, body).await).await }
    };
    let move_1_to_2 =
        json!({"workflow": "order", "from": 1, "to": 2, "mapping": {"charge_payment": "charge"}});
    let with_confirm = |confirm: Value| {
        let mut body = move_1_to_2.clone();
        body["confirm"] = confirm;
        body
    };

    // Refused: a viewer (a look or a move); requests that are no move; an
    // unknown version; more orders than confirmed.
    for body in [move_1_to_2.clone(), with_confirm(json!(3))] {
        let (status, answer) = post(As::Viewer, body).await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{answer}");
    }
    for body in [
        json!({"workflow": "order", "from": 1}),
        json!({"workflow": "order", "from": 1, "to": 1}),
        json!({"workflow": "no way", "from": 1, "to": 2}),
        json!({"workflow": "order", "from": 1, "to": 2, "mapping": ["charge_payment=charge"]}),
        json!({"workflow": "order", "from": 1, "to": 2, "mapping": {"charge_payment": ""}}),
        json!({"workflow": "order", "from": 1, "to": 2, "confirmed": 3}),
        with_confirm(json!(-1)),
    ] {
        let (status, answer) = post(As::Operator, body.clone()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {answer}");
    }
    let (status, answer) = post(
        As::Operator,
        json!({"workflow": "order", "from": 1, "to": 9}),
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{answer}");
    assert!(
        answer["error"]
            .as_str()
            .is_some_and(|e| e.starts_with("version 9 of workflow \"order\" is unknown")),
        "{answer}"
    );

    // A look: all three would move, nothing changes.
    let (status, look) = post(As::Operator, move_1_to_2.clone()).await;
    assert_eq!(status, StatusCode::OK, "{look}");
    assert_eq!(look["applied"], false, "{look}");
    assert_eq!(look["refused"], json!([]), "{look}");
    assert_eq!(look["not_waiting"], 0, "{look}");
    let expected: Vec<Value> = ids
        .iter()
        .map(|id| json!({"order_id": id, "detail": MOVED_1_TO_2}))
        .collect();
    assert_eq!(look["moved"], json!(expected), "{look}");
    assert!(
        look["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("3 would move from version 1 to 2 of order, 0 refused")),
        "{look}"
    );
    let (status, answer) = post(As::Operator, with_confirm(json!(2))).await;
    assert_eq!(status, StatusCode::CONFLICT, "{answer}");
    assert!(
        answer["error"].as_str().is_some_and(|e| e
            .contains("3 orders would move now, more than the 2 confirmed")
            && e.contains("nothing was moved")),
        "{answer}"
    );
    // The page's form refuses the same, and says so on the page.
    let token = console.csrf(As::Operator).await;
    let page = console
        .request(reqwest::Method::POST, "/workflows/move", As::Operator)
        .form(&[
            ("csrf_token", token.as_str()),
            ("workflow", "order"),
            ("from", "1"),
            ("to", "2"),
            ("mapping", "charge_payment=charge"),
            ("confirm", "1"),
        ])
        .send()
        .await
        .unwrap();
    assert_eq!(page.status(), StatusCode::CONFLICT);
    let page = page.text().await.unwrap();
    assert!(
        page.contains("id=\"move-error\"") && page.contains("more than the 1 confirmed"),
        "{page}"
    );
    for id in ids {
        assert_eq!(
            env.detail(id).await.summary.workflow_version,
            1,
            "{id}: nothing moved yet"
        );
    }

    // The confirmed move.
    let (status, done) = post(As::Operator, with_confirm(json!(3))).await;
    assert_eq!(status, StatusCode::OK, "{done}");
    assert_eq!(done["applied"], true, "{done}");
    assert_eq!(done["moved"], json!(expected), "{done}");
    assert!(
        done["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("3 moved from version 1 to 2 of order")),
        "{done}"
    );
    for id in ids {
        let moved = assert_moved_to_version_2(&env, id).await;
        assert_eq!(moved.actor, format!("console:{}", OPERATOR.0));
    }
    let list = workflows(&console).await;
    assert_eq!(
        order_at(&list, 1).map(|v| &v["orders"]),
        Some(&json!({"waiting": 0, "running": 0, "ended": 0}))
    );
    assert_eq!(
        order_at(&list, 2).map(|v| &v["orders"]),
        Some(&json!({"waiting": 3, "running": 0, "ended": 0}))
    );

    // An unsafe move: version 3 has no reservation, which completed. The
    // look says why for each order, and the move takes none.
    let v3: Vec<sas_store::NewStep> = env.steps().into_iter().skip(1).collect();
    env.store
        .writes()
        .register_plans(&[sas_store::Plan::new("order", 3, &v3)])
        .await
        .unwrap();
    let move_2_to_3 = json!({"workflow": "order", "from": 2, "to": 3});
    let (status, look) = post(As::Operator, move_2_to_3.clone()).await;
    assert_eq!(status, StatusCode::OK, "{look}");
    assert_eq!(look["moved"], json!([]), "{look}");
    let refused = look["refused"].as_array().cloned().unwrap_or_default();
    assert_eq!(refused.len(), 3, "{look}");
    for entry in &refused {
        assert!(
            entry["reason"]
                .as_str()
                .is_some_and(|r| r.contains("\"reserve_stock\" did (or may have done) its action")),
            "{entry}"
        );
    }
    let mut confirmed = move_2_to_3.clone();
    confirmed["confirm"] = json!(0);
    let (status, done) = post(As::Operator, confirmed).await;
    assert_eq!(status, StatusCode::OK, "{done}");
    assert_eq!(done["applied"], true, "{done}");
    assert_eq!(done["moved"], json!([]), "{done}");
    assert_eq!(done["refused"].as_array().map(Vec::len), Some(3), "{done}");
    for id in ids {
        assert_eq!(env.detail(id).await.summary.workflow_version, 2, "{id}");
    }

    // The page lists every version with its counts, to a viewer too; only
    // an operator gets the move form.
    for (who, form) in [(As::Viewer, false), (As::Operator, true)] {
        let page = console.get("/workflows", who).await;
        assert_eq!(page.status(), StatusCode::OK);
        let page = page.text().await.unwrap();
        assert!(page.contains("<a href=\"/workflows\""), "in the navigation");
        for row in [
            "data-workflow=\"order\" data-version=\"1\" data-waiting=\"0\" data-running=\"0\" data-ended=\"0\"",
            "data-workflow=\"order\" data-version=\"2\" data-waiting=\"3\" data-running=\"0\" data-ended=\"0\"",
            "data-workflow=\"order\" data-version=\"3\" data-waiting=\"0\"",
            "data-step=\"cooling_off\" data-kind=\"delay\"",
            "data-step=\"approval\" data-kind=\"wait\"",
            "data-step=\"charge\" data-kind=\"call\"",
        ] {
            assert!(page.contains(row), "{who:?}: {row}");
        }
        assert_eq!(page.contains("id=\"move-form\""), form, "{who:?}");
    }
    let page = console
        .request(reqwest::Method::POST, "/workflows/move", As::Viewer)
        .form(&[("workflow", "order"), ("from", "2"), ("to", "3")])
        .send()
        .await
        .unwrap();
    assert_eq!(page.status(), StatusCode::FORBIDDEN);

    // The moved orders run version 2 once approved: its charge, under the
    // key they had.
    for id in ids {
        let (status, answer) = status_and_json(
            console
                .act(
                    &format!("/api/orders/{id}/signal"),
                    As::Operator,
                    json!({"event": "approved"}),
                )
                .await,
        )
        .await;
        assert_eq!(status, StatusCode::OK, "{answer}");
    }
    for id in ids {
        env.wait_for_state(id, ProcessState::Processed, Duration::from_secs(30))
            .await;
    }
    let effects = sim.side_effects().await.unwrap();
    for id in ids {
        let charge = effects
            .iter()
            .find(|e| e.key == format!("{id}:charge_payment"))
            .unwrap_or_else(|| panic!("no charge for {id}"));
        assert_eq!(charge.body["plan"], "version 2");
    }
    sim.assert_every_order_done_once().await;
    let list = workflows(&console).await;
    assert_eq!(
        order_at(&list, 2).map(|v| &v["orders"]),
        Some(&json!({"waiting": 0, "running": 0, "ended": 3}))
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn an_operator_looks_then_moves_waiting_orders_on_the_workflows_page_in_a_browser() {
    let env = TestEnv::new().await;
    let (_connection, publisher) = env.broker().await;
    let ids = ["web-move-0", "web-move-1"];
    let (_services, _sim, console) = parked_under_version_1(&env, &publisher, &ids).await;

    let browser = Browser::start(&env.id).await;
    let base = console
        .base
        .replace("http://", &format!("http://{}:{}@", OPERATOR.0, OPERATOR.1));
    browser.goto(&format!("{base}/workflows")).await;
    assert_eq!(
        browser.count("#workflows tr[data-workflow='order']").await,
        2
    );
    assert_eq!(
        browser
            .text("#workflows tr[data-version='1'] td.waiting")
            .await,
        "2"
    );
    let steps = browser
        .text("#workflows tr[data-version='1'] ol.steps")
        .await;
    assert!(
        steps.contains("approval: wait for approved") && steps.contains("cooling_off: delay 600 s"),
        "{steps}"
    );
    browser.screenshot("01-workflows-two-versions").await;

    // An unknown version: the error, on the page, and nothing moved.
    browser
        .type_into("#move-form input[name='workflow']", "order")
        .await;
    browser
        .type_into("#move-form input[name='from']", "1")
        .await;
    browser.type_into("#move-form input[name='to']", "9").await;
    browser.click("#look").await;
    let error = browser.text("#move-error").await;
    assert!(
        error.contains("version 9 of workflow \"order\" is unknown"),
        "{error}"
    );

    // The look, then the button.
    browser.goto(&format!("{base}/workflows")).await;
    browser
        .type_into("#move-form input[name='workflow']", "order")
        .await;
    browser
        .type_into("#move-form input[name='from']", "1")
        .await;
    browser.type_into("#move-form input[name='to']", "2").await;
    browser
        .type_into(
            "#move-form textarea[name='mapping']",
            "charge_payment=charge",
        )
        .await;
    browser.click("#look").await;
    assert_eq!(browser.text("#confirm-move").await, "Move 2 orders");
    assert_eq!(browser.count("#move-moved tr[data-order]").await, 2);
    let would = browser.text("#move-moved").await;
    assert!(would.contains(MOVED_1_TO_2), "{would}");
    for id in ids {
        assert_eq!(
            env.detail(id).await.summary.workflow_version,
            1,
            "a look changes nothing"
        );
    }
    browser.screenshot("02-move-look").await;

    browser.click("#confirm-move").await;
    let done = browser.text("#move-done").await;
    assert!(
        done.contains("2 moved from version 1 to 2 of order") && done.contains("console:ann"),
        "{done}"
    );
    assert_eq!(
        browser
            .text("#workflows tr[data-version='2'] td.waiting")
            .await,
        "2"
    );
    assert_eq!(
        browser
            .text("#workflows tr[data-version='1'] td.waiting")
            .await,
        "0"
    );
    browser.screenshot("03-moved").await;
    browser.close().await;
    for id in ids {
        assert_eq!(env.detail(id).await.summary.workflow_version, 2, "{id}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn an_operator_the_wait_does_not_accept_is_refused_at_once_and_nothing_is_sent() {
    let env = TestEnv::new().await;
    // large_order's approval accepts role:approver; this console's
    // operator does not hold it.
    let tenancy = std::env::temp_dir().join(format!("{}-console-tenancy.toml", env.id));
    std::fs::write(&tenancy, "[roles]\napprover = [\"console:someone-else\"]\n").unwrap();
    let (sim_process, sim) = env.remote_sim(&[]).await;
    let _agents = env.agents(1, &sim, &[]);
    let _scheduler = env.scheduler(0, &shipped_workflows());
    let _supervisor = env.supervisor(0, &[]);
    let (_console_process, console) = env
        .console(&[Setting::Raw(
            "SAS_CONSOLE__TENANCY_FILE",
            tenancy.display().to_string(),
        )])
        .await;
    let (_connection, publisher) = env.broker().await;
    parked_large_order(&env, &publisher, "big-1").await;

    let (status, answer) = status_and_json(
        console
            .act(
                "/api/orders/big-1/signal",
                As::Operator,
                json!({"event": "approved"}),
            )
            .await,
    )
    .await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{answer}");
    let error = answer["error"].as_str().unwrap_or_default();
    assert!(
        error.contains("accepts approved only from role:approver")
            && error.contains("nothing was sent"),
        "{error}"
    );
    assert!(mailbox(&env, "big-1").await.is_empty(), "nothing was sent");
    assert_eq!(env.state_of("big-1").await, Some(ProcessState::Pending));
    drop(sim_process);
    let _ = std::fs::remove_file(&tenancy);
}
