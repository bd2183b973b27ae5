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
                    .reads()
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
        env.state_of("ord-web-0").await,
        Some(ProcessState::Processing),
        "nothing happens before the confirmation"
    );
    browser.click("#confirm").await;
    browser
        .wait_for_attribute("#bulk-applied", "data-count", "3", Duration::from_secs(20))
        .await;
    browser.screenshot("04-bulk-cancel-done").await;
    assert_eq!(
        env.state_of("ord-other").await,
        Some(ProcessState::Processing),
        "an order the filter left out runs on"
    );

    // The payment agent comes; the cancelled orders are undone. The order
    // page follows it live, without a reload.
    let _payment = env.agent("payment", 0, &sim, &[]);
    browser.goto(&format!("{base}/orders/ord-web-0")).await;
    let history = browser.text("#history").await;
    assert!(
        history.contains("cancelled") && history.contains("console:ann"),
        "{history}"
    );
    assert_eq!(
        browser
            .count("#timeline g.mark.order[data-event='cancelled']")
            .await,
        1,
        "the cancellation is marked across the lanes"
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
    let history = browser.text("#history").await;
    assert!(history.contains("resubmitted"), "{history}");
    browser.screenshot("06-order-resubmitted-processed").await;
    // Its timeline: the cancelled run's reservation undone (an outlined
    // bar in the lower half of its lane), then a bar per step of the
    // resubmitted run, every one succeeded; 3 lanes.
    assert_eq!(browser.count("#timeline rect.lane").await, 3);
    let undone = browser.count("#timeline rect.attempt.ok.undo").await;
    assert!(undone >= 1, "{undone} undo bars");
    let succeeded = browser.count("#timeline rect.attempt.ok:not(.undo)").await;
    assert!(
        succeeded >= 4,
        "{succeeded} succeeded actions (reserve twice, payment, shipping)"
    );
    assert_eq!(
        browser
            .count("#timeline g.mark.order[data-event='resubmitted']")
            .await,
        1
    );
    browser
        .execute("document.getElementById('timeline').scrollIntoView();")
        .await;
    browser.screenshot("06b-order-timeline").await;
    env.wait_for_state("ord-web-0", ProcessState::Processed, Duration::from_secs(5))
        .await;

    // Replay a dead letter: an order that was dead-lettered on its way in.
    let mut lost = order("ord-web-replayed");
    lost.customer_id = "cust-web".into();
    let letter: i64 = sqlx::query_scalar(
        "INSERT INTO dead_letters (source_queue, reason, order_id, body) VALUES ($1, 'rejected by RabbitMQ: delivery_limit', 'ord-web-replayed', $2) RETURNING id",
    )
    .bind(env.amqp().names().orders())
    .bind(serde_json::to_string(&lost).unwrap())
    .fetch_one(&env.db)
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
    env.wait_for_state(
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

    // The overview's charts of the last hour: throughput counts the orders
    // processed, each with a value axis and a time axis.
    browser.goto(&format!("{base}/")).await;
    let throughput = browser
        .execute(
            "return document.querySelector('#chart-throughput svg').getAttribute('aria-label');",
        )
        .await;
    let most: i64 = throughput
        .as_str()
        .and_then(|label| label.rsplit(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{throughput}"));
    assert!(most >= 1, "{throughput}");
    for id in ["chart-throughput", "chart-backlog", "chart-compensations"] {
        let text = browser.text(&format!("#{id}")).await;
        assert!(
            text.contains("-30 min") && text.contains("now"),
            "{id}: {text}"
        );
    }
    browser
        .execute("document.getElementById('charts').scrollIntoView();")
        .await;
    browser.screenshot("10-overview-charts").await;

    // A long run: 12 steps, 20 attempts (retries, a line, a failure for
    // good, undos, an operator's cancel), drawn by the console's own code.
    let page = browser.screenshots().join("timeline-12-steps.html");
    std::fs::write(&page, long_run_page()).expect("write the long run's page");
    browser.goto(&format!("file://{}", page.display())).await;
    assert_eq!(browser.count("rect.lane").await, 12);
    assert_eq!(browser.count("rect.attempt").await, 20);
    browser.screenshot("09-timeline-12-steps-20-attempts").await;
    browser.close().await;
}

/// A page holding the console's stylesheet and the timeline of a made-up
/// order of 12 steps whose run took 20 attempts.
fn long_run_page() -> String {
    use chrono::{DateTime, Utc};
    use sas_console::timeline::{legend, svg, Timeline};
    use sas_store::machine::HistoryEvent as E;
    use sas_store::reads::queries::HistoryEntry;

    let start = Utc::now() - chrono::Duration::seconds(90);
    let mut history = Vec::new();
    let mut push =
        |ms: i64, event: E, step: Option<usize>, attempt: Option<u128>, detail: Option<&str>| {
            history.push(HistoryEntry {
                at: start + chrono::Duration::milliseconds(ms),
                actor: if event == E::Cancelled {
                    "console:ann".into()
                } else {
                    "scheduler-1".into()
                },
                event,
                step: step.map(|i| format!("step_{:02}", i + 1)),
                attempt_id: attempt.map(uuid::Uuid::from_u128),
                detail: detail.map(str::to_owned),
            });
        };
    push(0, E::Received, None, None, None);
    let mut at = 10;
    let mut attempt = 0;
    // Steps 1 to 9 forward: step 3 misses a deadline once, step 5 waits in
    // its agent's line, step 7 fails twice transiently.
    for step in 0..9 {
        let tries = match step {
            2 => 2,
            6 => 3,
            _ => 1,
        };
        if step == 4 {
            push(at, E::Queued, Some(step), None, Some("waiting for a slot"));
            at += 4_000;
        }
        for t in 0..tries {
            attempt += 1;
            push(at, E::Dispatched, Some(step), Some(attempt), None);
            at += 900 + 150 * step as i64;
            if t + 1 < tries {
                if step == 2 {
                    push(
                        at + 2_000,
                        E::RetryScheduled,
                        Some(step),
                        None,
                        Some("deadline passed"),
                    );
                    at += 4_500;
                } else {
                    push(
                        at,
                        E::TransientFailure,
                        Some(step),
                        Some(attempt),
                        Some("503 from the remote"),
                    );
                    at += 2_500;
                }
            } else {
                push(at, E::StepCompleted, Some(step), Some(attempt), None);
                at += 20;
            }
        }
    }
    // Step 10 fails for good; an operator had cancelled meanwhile: undo 9 to
    // 1 (steps 2 and 6 have no undo); steps 11 and 12 never run.
    attempt += 1;
    push(at, E::Dispatched, Some(9), Some(attempt), None);
    push(at + 600, E::Cancelled, None, None, Some("customer called"));
    at += 1_800;
    push(
        at,
        E::CompensationStarted,
        Some(9),
        Some(attempt),
        Some("card declined"),
    );
    for step in (0..9).rev().filter(|s| *s != 1 && *s != 5) {
        attempt += 1;
        at += 30;
        push(
            at,
            E::CompensationDispatched,
            Some(step),
            Some(attempt),
            None,
        );
        at += 700;
        push(at, E::StepCompensated, Some(step), Some(attempt), None);
    }
    push(at + 10, E::Compensated, None, None, None);
    let lanes: Vec<String> = (1..=12).map(|i| format!("step_{i:02}")).collect();
    let end: DateTime<Utc> = start + chrono::Duration::milliseconds(at + 10);
    let timeline = Timeline::build(&lanes, &history, end, false);
    format!(
        "<!DOCTYPE html><html><head><meta charset=\"utf-8\"><style>{}</style></head><body><main><h2>Timeline</h2><figure id=\"timeline\">{}<figcaption>{}</figcaption></figure></main></body></html>",
        include_str!("../../../crates/console/static/console.css"),
        svg(&timeline).into_string(),
        legend().into_string(),
    )
}
