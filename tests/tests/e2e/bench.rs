//! The benchmark's quick mode runs with the tests, so that it cannot rot.
//! It asserts that it ran and that its figures are sane, not that they are fast.
//! It loads the whole machine, so it holds the servers alone.

use sas_tests::process::bin_dir;
use sas_tests::ServerGuard;

#[test]
fn the_quick_benchmark_runs_and_reports_sane_figures() {
    // sas-bench makes its own envs, in its own process.
    let _alone = ServerGuard::exclusive_blocking();
    let out = std::env::temp_dir().join(format!("sas-bench-{}.json", std::process::id()));
    let unix_ms = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as f64
    };
    let began = unix_ms();
    // One order in 5 urgent, not the default 10, to see the option reach
    // the phase.
    let status = std::process::Command::new(bin_dir().join("sas-bench"))
        .args(["--quick", "--urgent-every", "5", "--out"])
        .arg(&out)
        .status()
        .expect("run sas-bench (cargo build --workspace --bins builds it)");
    assert!(status.success());
    let ended = unix_ms();
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    let _ = std::fs::remove_file(&out);
    let number = |path: &str| {
        report
            .pointer(path)
            .and_then(serde_json::Value::as_f64)
            .unwrap_or_else(|| panic!("{path} missing: {report}"))
    };
    for field in [
        "/orders_per_sec",
        "/broker_limit_msgs_per_sec",
        "/postgres_limit_commits_per_sec",
        "/efficiency",
        "/recovery_secs",
    ] {
        let value = number(field);
        assert!(value.is_finite() && value > 0.0, "{field} = {value}");
    }
    // Each order is at least the order itself, three requests and three replies.
    assert!(number("/msgs_per_order") >= 7.0, "{report}");
    // And status messages: received, three step_completed, processed, each
    // to the status exchange and to the reply_to queue.
    assert!(number("/status_msgs_per_order") >= 5.0, "{report}");
    // Intake and replies are batched, so commits per order may be under one,
    // but never none and never more than one per transition.
    let commits = number("/pg_commits_per_order");
    assert!(commits > 0.0 && commits <= 6.0, "{report}");
    for program in ["scheduler", "agent", "postgres", "rabbitmq"] {
        let cpu = number(&format!("/cpu_ms_per_order/{program}"));
        assert!(cpu > 0.0 && cpu < 1000.0, "{program}: {cpu} ms per order");
    }
    let (p50, p95, p99) = (
        number("/latency_ms/p50"),
        number("/latency_ms/p95"),
        number("/latency_ms/p99"),
    );
    assert!(0.0 < p50 && p50 <= p95 && p95 <= p99, "{p50} {p95} {p99}");
    // The timeline holds the orders the percentiles were taken from, in
    // the order sent, from the first publish on.
    let timeline: Vec<(f64, f64)> = report["latency_timeline"]
        .as_array()
        .expect("latency_timeline")
        .iter()
        .map(|point| (point[0].as_f64().unwrap(), point[1].as_f64().unwrap()))
        .collect();
    // Every order of the phase (1.5 s of load in the quick mode, at least
    // 30), the last sent about when the rate schedules it.
    let rate = number("/latency_rate_orders_per_sec");
    let orders = ((rate * 1.5) as usize).max(30);
    assert_eq!(timeline.len(), orders, "rate {rate}");
    assert_eq!(timeline[0].0, 0.0);
    assert!(timeline.windows(2).all(|pair| pair[0].0 <= pair[1].0));
    let (last, scheduled) = (timeline[orders - 1].0, (orders - 1) as f64 / rate);
    assert!(
        (0.8 * scheduled..scheduled + 2.0).contains(&last),
        "last sent at {last} s, scheduled at {scheduled} s"
    );
    let slowest = timeline.iter().map(|(_, ms)| *ms).fold(0.0, f64::max);
    assert!(p99 <= slowest && timeline.iter().all(|(_, ms)| *ms > 0.0));
    let started = number("/latency_timeline_started_unix_ms");
    assert!(
        (began..ended).contains(&started),
        "{began} {started} {ended}"
    );
    // The latency phase's CPU, and how busy it kept the machine.
    for program in ["scheduler", "agent", "postgres", "rabbitmq"] {
        let cpu = number(&format!("/latency_cpu_ms_per_order/{program}"));
        assert!(cpu > 0.0 && cpu < 1000.0, "{program}: {cpu} ms per order");
    }
    // What the order's bare messages and commits cost RabbitMQ and Postgres
    // alone at that rate: per message and per commit, tenths of a
    // millisecond here; and in the order of what the system's own load
    // cost them per order (which holds status messages and coalesces), not
    // a multiple of it nor a small fraction.
    let per_item = [("rabbitmq", number("/msgs_per_order")), ("postgres", 4.0)];
    for (program, items) in per_item {
        let bare = number(&format!("/latency_bare_cpu_ms_per_order/{program}"));
        let each = bare / items;
        assert!(
            (0.01..20.0).contains(&each),
            "{program}: {each} ms per item ({bare} per order)"
        );
        let system = number(&format!("/latency_cpu_ms_per_order/{program}"));
        assert!(
            bare < 3.0 * system,
            "{program}: bare {bare} against {system} ms per order in the system"
        );
    }
    let (bare, system) = (
        number("/latency_bare_cpu_ms_per_order/rabbitmq"),
        number("/latency_cpu_ms_per_order/rabbitmq"),
    );
    assert!(
        bare > 0.2 * system,
        "rabbitmq: bare {bare} against {system} ms per order in the system"
    );
    let busy = number("/latency_cpu_busy");
    // A share of the cores: never above all of them (a little slack for
    // the CPU read just outside the phase's clock).
    assert!(busy > 0.0 && busy <= 1.1, "busy {busy}");
    let scaling = report["scaling"].as_array().unwrap();
    assert!(scaling.len() >= 2);
    assert!(scaling
        .iter()
        .all(|point| point["orders_per_sec"].as_f64().unwrap() > 0.0));
    for binary in ["scheduler", "agent", "supervisor", "remote-sim"] {
        let peak = number(&format!("/rss_mib/{binary}"));
        assert!(peak > 1.0 && peak < 4096.0, "{binary}: {peak} MiB");
    }
    assert!(number("/recovery_secs") < number("/recovery_bound_secs") + 30.0);
    let overload = report["overload"].as_array().expect("overload points");
    assert_eq!(overload.len(), 2, "{report}");
    for point in overload {
        assert_eq!(point["failed_or_compensated"], 0, "{point}");
        assert_eq!(point["urgent_every"], 5, "{point}");
        let orders = point["orders"].as_u64().unwrap();
        assert_eq!(point["urgent_orders"].as_u64(), Some(orders / 5), "{point}");
        let goodput = point["goodput_fraction"].as_f64().unwrap_or_default();
        assert!(goodput > 0.0 && goodput < 2.0, "{point}");
        // An urgent order's first step is done after one 100 ms call at
        // least, and before the order is.
        let at = |path: &str| point.pointer(path).and_then(|v| v.as_f64()).unwrap();
        for q in ["p50", "p99"] {
            let (first, whole) = (
                at(&format!("/urgent_first_step_ms/{q}")),
                at(&format!("/latency_urgent_ms/{q}")),
            );
            assert!(100.0 <= first && first < whole, "{q}: {point}");
        }
    }
    // Urgent orders alone still make three calls of 100 ms each, and with
    // no backlog to pass they take little more.
    let alone = number("/overload_urgent_alone_ms/p99");
    assert!(
        (300.0..1_500.0).contains(&alone),
        "urgent alone: {alone} ms"
    );
    let alone_first = number("/overload_urgent_alone_first_step_ms/p99");
    assert!(
        (100.0..alone).contains(&alone_first),
        "urgent alone, first step: {alone_first} ms"
    );
    // The keyed phase: the same orders without limits by key, with a fixed
    // one and with an adaptive one, each processed and costed; the
    // adaptive run's keys learnt limits (one per merchant it charged).
    for run in ["plain", "fixed", "adaptive"] {
        let rate = number(&format!("/keyed/runs/{run}/orders_per_sec"));
        assert!(rate.is_finite() && rate > 0.0, "keyed {run}: {rate}");
        let commits = number(&format!("/keyed/runs/{run}/pg_commits_per_order"));
        assert!(commits > 0.0 && commits <= 10.0, "keyed {run}: {commits}");
        let cpu = number(&format!("/keyed/runs/{run}/cpu_ms_per_order/scheduler"));
        assert!(cpu > 0.0 && cpu < 1000.0, "keyed {run}: {cpu} ms per order");
    }
    assert!(number("/keyed/keys_learnt") >= 1.0, "{report}");
    // The noisy-neighbour phase: the quiet tenant's orders make three calls
    // of 100 ms each, alone and beside the noisy one, every one measured.
    let neighbours = &report["neighbours"];
    let quiet = neighbours["quiet_orders"].as_u64().expect("quiet orders");
    assert!(quiet > 0, "{neighbours}");
    assert_eq!(
        neighbours["noisy_orders"].as_u64(),
        Some(quiet * 100),
        "{neighbours}"
    );
    for half in ["quiet_alone_ms", "quiet_beside_noisy_ms"] {
        let p50 = number(&format!("/neighbours/{half}/p50"));
        let p99 = number(&format!("/neighbours/{half}/p99"));
        assert!(300.0 <= p50 && p50 <= p99, "{half}: {neighbours}");
    }
}
