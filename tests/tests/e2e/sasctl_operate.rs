//! `sasctl` does what the console does: orders by filter, bulk cancel after
//! the count, stats, alerts acknowledged and resolved, dead letters
//! replayed and discarded, `-o json` for scripts, and `submit --count`
//! printing every id once confirmed.

use std::time::Duration;

use sas_store::ProcessState;
use sas_tests::Setting;
use sas_tests::{wait_until, TestEnv};
use serde_json::Value;

#[tokio::test(flavor = "multi_thread")]
async fn sasctl_filters_bulk_cancels_resolves_alerts_and_replays_dead_letters() {
    let env = TestEnv::with_step_timeout(10_000).await;
    // No agent: the orders stay at their first step.
    let _scheduler = env.scheduler(0, &[]);
    let _supervisor = env.supervisor(0, &[]);
    let (code, out) = env
        .sasctl(&[
            "submit",
            "--count",
            "3",
            "--order-id",
            "ord-s",
            "--customer-id",
            "cust-s",
        ])
        .await;
    assert_eq!(code, 0);
    let ids: Vec<&str> = out.lines().collect();
    assert_eq!(ids.len(), 3, "one id per confirmed order: {out}");
    for i in 0..3 {
        assert!(ids.contains(&format!("ord-s-{i}").as_str()), "{out}");
    }
    env.wait_for_count(ProcessState::Processing, 3, Duration::from_secs(20))
        .await;

    let (code, out) = env
        .sasctl(&["orders", "list", "--customer", "cust-s", "-o", "json"])
        .await;
    assert_eq!(code, 0);
    let page: Value = serde_json::from_str(&out).expect("JSON");
    assert_eq!(page["orders"].as_array().unwrap().len(), 3, "{page}");
    let (code, _) = env.sasctl(&["orders", "list", "--state", "bogus"]).await;
    assert_ne!(code, 0, "a bad filter is refused");

    // Bulk cancel: the count, a stale confirmation, then the action.
    let (code, out) = env
        .sasctl(&["bulk", "cancel", "--customer", "cust-s"])
        .await;
    assert_eq!(code, 0);
    assert!(
        out.contains("3 orders match") && out.contains("--confirm 3"),
        "{out}"
    );
    let (code, _) = env
        .sasctl(&["bulk", "cancel", "--customer", "cust-s", "--confirm", "2"])
        .await;
    assert_eq!(code, 1, "more orders match than were confirmed");
    assert_eq!(
        env.count(ProcessState::Processing).await,
        3,
        "nothing was done"
    );
    let (code, out) = env
        .sasctl(&[
            "bulk",
            "cancel",
            "--customer",
            "cust-s",
            "--confirm",
            "3",
            "-o",
            "json",
            "--actor",
            "ann",
        ])
        .await;
    assert_eq!(code, 0);
    let outcome: Value = serde_json::from_str(&out).expect("JSON");
    assert_eq!(outcome["applied"].as_array().unwrap().len(), 3, "{outcome}");
    let history = env.store.reads().history("ord-s-0").await.unwrap();
    assert!(
        history
            .iter()
            .any(|h| h.event.as_str() == "cancelled" && h.actor == "sasctl:ann"),
        "{history:?}"
    );

    let (code, out) = env.sasctl(&["stats", "-o", "json"]).await;
    assert_eq!(code, 0);
    let stats: Value = serde_json::from_str(&out).expect("JSON");
    assert!(
        stats["by_state"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p[0] == "compensating" && p[1] == 3),
        "{stats}"
    );
    let (code, out) = env.sasctl(&["stats"]).await;
    assert_eq!(code, 0);
    assert!(
        out.contains("compensating") && out.contains("open alerts 0"),
        "{out}"
    );

    // Alerts.
    let alert: i64 = sqlx::query_scalar("INSERT INTO alerts (order_id, kind, message) VALUES ('ord-s-0', 'compensation_failed', 'test') RETURNING id")
        .fetch_one(&env.db)
        .await
        .unwrap();
    let id = alert.to_string();
    assert_eq!(env.sasctl(&["alerts", "acknowledge", &id]).await.0, 0);
    assert_eq!(
        env.sasctl(&["alerts", "resolve", &id, "--note", "refunded by hand"])
            .await
            .0,
        0
    );
    assert_eq!(
        env.sasctl(&["alerts", "resolve", &id, "--note", "again"])
            .await
            .0,
        1,
        "resolved once"
    );
    let (_, out) = env.sasctl(&["alerts", "--all", "-o", "json"]).await;
    let alerts: Value = serde_json::from_str(&out).expect("JSON");
    assert_eq!(alerts[0]["resolution_note"], "refunded by hand", "{alerts}");
    let acknowledged_by = alerts[0]["acknowledged_by"].as_str().unwrap_or_default();
    assert!(
        acknowledged_by.starts_with("sasctl:") && acknowledged_by.len() > "sasctl:".len(),
        "without --actor, the operating-system user: {alerts}"
    );

    // Dead letters.
    let mut lost = sas_tests::order("ord-s-replayed");
    lost.customer_id = "cust-s".into();
    let replay: i64 = sqlx::query_scalar("INSERT INTO dead_letters (source_queue, reason, body) VALUES ($1, 'delivery_limit', $2) RETURNING id")
        .bind(env.amqp().names().orders())
        .bind(serde_json::to_string(&lost).unwrap())
        .fetch_one(&env.db)
        .await
        .unwrap();
    let foreign: i64 = sqlx::query_scalar("INSERT INTO dead_letters (source_queue, reason, body) VALUES ('elsewhere', 'x', '{}') RETURNING id")
        .fetch_one(&env.db)
        .await
        .unwrap();
    assert_eq!(
        env.sasctl(&["dead-letters", "replay", &replay.to_string()])
            .await
            .0,
        0
    );
    env.wait_stored("ord-s-replayed", Duration::from_secs(20))
        .await;
    assert_eq!(
        env.sasctl(&["dead-letters", "replay", &replay.to_string()])
            .await
            .0,
        1,
        "replayed once"
    );
    assert_eq!(
        env.sasctl(&["dead-letters", "replay", &foreign.to_string()])
            .await
            .0,
        1,
        "not a queue of this deployment"
    );
    assert_eq!(
        env.sasctl(&["dead-letters", "discard", &foreign.to_string()])
            .await
            .0,
        0
    );
    let (_, out) = env.sasctl(&["dead-letters", "-o", "json"]).await;
    let letters: Value = serde_json::from_str(&out).expect("JSON");
    let disposition = |id: i64| sas_tests::disposition_of(&letters, id);
    assert_eq!(disposition(replay), "replayed");
    assert_eq!(disposition(foreign), "discarded");
}

/// `sasctl stats` shows the real backlog: the agents' lines, which admission
/// control keeps in Postgres (the agent queue holds only what was admitted).
/// With a limit of one and no agent running, one order is in flight and two
/// wait, the oldest for as long as it has been in line; with no supervisor,
/// the cap up to which urgent orders pass the limit is still 0.
#[tokio::test(flavor = "multi_thread")]
async fn sasctl_stats_shows_each_agent_s_line() {
    let env = TestEnv::with_step_timeout(10_000).await;
    let _scheduler = env.scheduler(
        0,
        &[
            Setting::SchedulerAdmissionInitial(1),
            Setting::SchedulerAdmissionCeiling(1),
        ],
    );
    let submitted = std::time::Instant::now();
    // One at a time: two intake batches at once may each see the one free
    // slot (the limit is soft by up to a batch; see docs/design-decisions.md).
    for n in 0..3 {
        let id = format!("ord-line-{n}");
        let (code, _) = env.sasctl(&["submit", "--order-id", &id]).await;
        assert_eq!(code, 0);
        env.wait_stored(&id, Duration::from_secs(20)).await;
    }
    let line = wait_until(
        "one order in flight to inventory and two in its line",
        Duration::from_secs(20),
        || async {
            let (code, out) = env.sasctl(&["stats", "-o", "json"]).await;
            let stats: Value =
                serde_json::from_str(&out).map_err(|e| format!("{code}: {e}: {out}"))?;
            let inventory = stats["admission"]
                .as_array()
                .and_then(|lines| lines.iter().find(|l| l["agent"] == "inventory").cloned())
                .ok_or_else(|| format!("no inventory line: {stats}"))?;
            (inventory["in_flight"] == 1
                && inventory["waiting"] == 2
                && inventory["admit_limit"] == 1)
                .then_some(inventory.clone())
                .ok_or_else(|| inventory.to_string())
        },
    )
    .await;
    let oldest = line["oldest_wait_secs"].as_f64().expect("an oldest wait");
    assert!(
        oldest >= 0.0 && oldest <= submitted.elapsed().as_secs_f64() + 1.0,
        "waited {oldest} s, submitted {:?} ago",
        submitted.elapsed()
    );
    assert!(line["ceiling"] == 1, "{line}");
    // No supervisor has measured the agent: nothing passes its limit.
    assert!(line["admit_cap"] == 0, "{line}");
    let (code, out) = env.sasctl(&["stats"]).await;
    assert_eq!(code, 0);
    let row = out
        .lines()
        .find(|l| l.starts_with("inventory"))
        .unwrap_or_else(|| panic!("no inventory row: {out}"));
    let columns: Vec<&str> = row.split_whitespace().collect();
    // Agent, waiting, in flight, limit, cap, ceiling.
    assert_eq!(
        &columns[..6],
        ["inventory", "2", "1", "1", "0", "1"],
        "{out}"
    );
    assert!(
        columns[6].ends_with('s'),
        "the oldest wait in seconds: {out}"
    );
    assert!(out.contains("OLDEST WAIT"), "{out}");
}

/// `sasctl` refuses an empty actor and deadlines that do not fit together,
/// prints completion scripts, and lists its exit codes under `--help`.
#[tokio::test(flavor = "multi_thread")]
async fn sasctl_checks_its_actor_and_offers_completions_and_exit_codes() {
    let env = TestEnv::new().await;
    let (code, _) = env
        .sasctl(&["cancel", "no-such-order", "--actor", " "])
        .await;
    assert_eq!(code, 1, "a blank actor is refused");
    // Deadlines that could let an undo reach a remote before its action's
    // late call are refused, naming the keys, as the services refuse them.
    let (code, _, errors) = env
        .sasctl_with_errors(&[
            "cancel",
            "no-such-order",
            "--deadlines-start-margin-ms",
            "100",
            "--deadlines-grace-ms",
            "100",
            "--deadlines-max-clock-skew-ms",
            "500",
        ])
        .await;
    assert_eq!(code, 1, "{errors}");
    assert!(errors.contains("deadlines.grace_ms"), "{errors}");
    let (code, script) = env.sasctl(&["completions", "bash"]).await;
    assert_eq!(code, 0);
    assert!(
        script.contains("_sasctl") && script.contains("dead-letters"),
        "{script}"
    );
    let (code, help) = env.sasctl(&["--help"]).await;
    assert_eq!(code, 0);
    for line in ["Exit codes:", "3  watch", "4  watch"] {
        assert!(help.contains(line), "{line:?} missing: {help}");
    }
}
