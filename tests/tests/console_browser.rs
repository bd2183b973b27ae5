//! The console in a real headless browser (Debian's chromium, driven
//! through chromedriver with the WebDriver protocol) against a running system: open
//! the overview, filter orders, bulk-cancel the filtered set after the
//! preview, watch an order's timeline reach `compensated` live, resubmit it
//! and watch it finish, replay a dead letter. Screenshots of each step are
//! saved under `target/screenshots/<test id>/`.

use std::time::Duration;

use sas_store::ProcessState;
use sas_tests::browser::Browser;
use sas_tests::console::OPERATOR;
use sas_tests::{order, wait_until, TestEnv};

async fn state_of(env: &TestEnv, order_id: &str) -> Option<ProcessState> {
    env.store
        .order_detail(order_id)
        .await
        .ok()
        .flatten()
        .map(|d| d.summary.state)
}

async fn wait_for_state(env: &TestEnv, order_id: &str, state: ProcessState, timeout: Duration) {
    wait_until(&format!("{order_id} {state}"), timeout, || async {
        match state_of(env, order_id).await {
            Some(seen) if seen == state => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn an_operator_filters_cancels_resubmits_and_replays_in_a_browser() {
    // Step deadlines long enough that orders wait at the payment step while
    // the browser works, with no payment agent yet.
    let env = TestEnv::with_step_timeout(10_000).await;
    let (_connection, publisher) = env.broker().await;
    let (_sim_process, sim) = env.remote_sim(&[]).await;
    let _inventory = env.agent("inventory", 0, &sim, &[]);
    let _shipping = env.agent("shipping", 0, &sim, &[]);
    let _scheduler = env.scheduler(0, &[]);
    let _supervisor = env.supervisor(0, &[]);
    let (_console_process, console) = env.console(&[]).await;
    let cancel: Vec<String> = (0..3).map(|i| format!("ord-web-{i}")).collect();
    for id in &cancel {
        let mut submitted = order(id);
        submitted.customer_id = "cust-web".into();
        env.publish_order(&publisher, &submitted).await;
    }
    let mut other = order("ord-other");
    other.customer_id = "cust-other".into();
    env.publish_order(&publisher, &other).await;
    for id in cancel
        .iter()
        .chain(std::iter::once(&"ord-other".to_owned()))
    {
        wait_until(
            &format!("{id} at the payment step"),
            Duration::from_secs(20),
            || async {
                let detail = env
                    .store
                    .order_detail(id)
                    .await
                    .map_err(|e| e.to_string())?
                    .ok_or("missing")?;
                let at_payment = detail
                    .steps
                    .iter()
                    .any(|s| s.name == "charge_payment" && s.attempt > 0);
                if at_payment {
                    Ok(())
                } else {
                    Err(format!("{:?}", detail.summary.state))
                }
            },
        )
        .await;
    }

    let browser = Browser::start(&env.id).await;
    let base = console
        .base
        .replace("http://", &format!("http://{}:{}@", OPERATOR.0, OPERATOR.1));

    // The overview shows the orders in flight.
    browser.goto(&format!("{base}/")).await;
    assert_eq!(browser.text("h1").await, "Overview");
    browser
        .wait_for_attribute(
            "#by-state td[data-state='processing']",
            "data-state",
            "processing",
            Duration::from_secs(5),
        )
        .await;
    let processing = browser.text("#by-state td[data-state='processing']").await;
    assert_eq!(processing, "4", "four orders wait at the payment step");
    // The agents' lines show them: four attempts in flight to payment.
    let in_flight = browser
        .text("#admission tr[data-agent='payment'] td[data-field='in_flight']")
        .await;
    assert_eq!(in_flight, "4", "the payment line holds the four attempts");
    browser.screenshot("01-overview").await;

    // Filter the orders by customer with the form.
    browser.click("header a[href='/orders']").await;
    browser
        .type_into("#filters input[name='customer']", "cust-web")
        .await;
    browser.click("#apply-filters").await;
    wait_until("the filtered list", Duration::from_secs(10), || async {
        match browser.count("#orders tr[data-order]").await {
            3 => Ok(()),
            rows => Err(format!("{rows} rows")),
        }
    })
    .await;
    let url = browser.current_url().await;
    assert!(url.contains("customer=cust-web"), "{url}");
    browser.screenshot("02-orders-filtered").await;

    // Bulk cancel: the preview counts three; confirm.
    browser.click("#bulk-cancel").await;
    browser
        .wait_for_attribute("#preview-count", "data-count", "3", Duration::from_secs(10))
        .await;
    browser.screenshot("03-bulk-cancel-preview").await;
    assert_eq!(
        state_of(&env, "ord-web-0").await,
        Some(ProcessState::Processing),
        "nothing happens before the confirmation"
    );
    browser.click("#confirm").await;
    browser
        .wait_for_attribute("#bulk-applied", "data-count", "3", Duration::from_secs(20))
        .await;
    browser.screenshot("04-bulk-cancel-done").await;
    assert_eq!(
        state_of(&env, "ord-other").await,
        Some(ProcessState::Processing),
        "an order the filter left out runs on"
    );

    // The payment agent comes; the cancelled orders are undone. The order
    // page follows it live, without a reload.
    let _payment = env.agent("payment", 0, &sim, &[]);
    browser.goto(&format!("{base}/orders/ord-web-0")).await;
    let timeline = browser.text("#timeline").await;
    assert!(
        timeline.contains("cancelled") && timeline.contains("console:ann"),
        "{timeline}"
    );
    browser.execute("window.notReloaded = true;").await;
    browser
        .wait_for_attribute(
            "#order-state",
            "data-state",
            "compensated",
            Duration::from_secs(60),
        )
        .await;
    let kept = browser.execute("return window.notReloaded === true;").await;
    assert_eq!(
        kept,
        serde_json::Value::Bool(true),
        "the page was updated in place, not reloaded"
    );
    browser.screenshot("05-order-compensated-live").await;

    // Resubmit it and watch it finish.
    browser.click("#resubmit").await;
    let notice = browser.text(".notice").await;
    assert!(notice.contains("resubmitted"), "{notice}");
    browser
        .wait_for_attribute(
            "#order-state",
            "data-state",
            "processed",
            Duration::from_secs(60),
        )
        .await;
    let timeline = browser.text("#timeline").await;
    assert!(timeline.contains("resubmitted"), "{timeline}");
    browser.screenshot("06-order-resubmitted-processed").await;
    wait_for_state(
        &env,
        "ord-web-0",
        ProcessState::Processed,
        Duration::from_secs(5),
    )
    .await;

    // Replay a dead letter: an order that was dead-lettered on its way in.
    let mut lost = order("ord-web-replayed");
    lost.customer_id = "cust-web".into();
    let letter: i64 = sqlx::query_scalar(
        "INSERT INTO dead_letters (source_queue, reason, order_id, body) VALUES ($1, 'rejected by RabbitMQ: delivery_limit', 'ord-web-replayed', $2) RETURNING id",
    )
    .bind(env.amqp().names().orders())
    .bind(serde_json::to_string(&lost).unwrap())
    .fetch_one(env.store.pool())
    .await
    .unwrap();
    browser.goto(&format!("{base}/dead-letters")).await;
    browser.screenshot("07-dead-letters").await;
    browser
        .click(&format!("tr[data-dead-letter='{letter}'] button.replay"))
        .await;
    let notice = browser.text(".notice").await;
    assert!(notice.contains("replayed"), "{notice}");
    let row = browser
        .text(&format!("tr[data-dead-letter='{letter}']"))
        .await;
    assert!(
        row.contains("replayed") && row.contains("console:ann"),
        "{row}"
    );
    wait_for_state(
        &env,
        "ord-web-replayed",
        ProcessState::Processed,
        Duration::from_secs(30),
    )
    .await;
    browser
        .goto(&format!("{base}/orders/ord-web-replayed"))
        .await;
    browser
        .wait_for_attribute(
            "#order-state",
            "data-state",
            "processed",
            Duration::from_secs(10),
        )
        .await;
    browser.screenshot("08-replayed-order-processed").await;
    browser.close().await;
}
