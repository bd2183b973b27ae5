//! OpenTelemetry: with `log.otlp_endpoint` set, every service exports its
//! spans over OTLP/HTTP (JSON) to a real receiver run by the test, and the
//! spans of one order (intake, each dispatch, the agent's step and call,
//! each reply, through compensation) make one trace across the scheduler
//! and the agents, the trace the order carries in its `traceparent`
//! headers; the remote service receives that trace too. A collector that
//! never answers holds up no order.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::routing::post;
use axum::Router;
use sas_store::ProcessState;
use sas_tests::process::free_port;
use sas_tests::Setting;
use sas_tests::{order, wait_until, TestEnv};
use serde_json::Value;

/// A span as the receiver got it: (service, trace id, name, its string attributes).
type Span = (String, String, String, HashMap<String, String>);

/// Starts an OTLP/HTTP receiver on a free port; every span it receives
/// goes into the returned list.
async fn receiver() -> (u16, Arc<Mutex<Vec<Span>>>) {
    let spans: Arc<Mutex<Vec<Span>>> = Arc::default();
    let kept = spans.clone();
    let app = Router::new().route(
        "/v1/traces",
        post(move |body: axum::body::Bytes| {
            let kept = kept.clone();
            async move {
                let request: Value = serde_json::from_slice(&body).expect("OTLP JSON");
                kept.lock().unwrap().extend(spans_of(&request));
                ([("content-type", "application/json")], "{}")
            }
        }),
    );
    let port = free_port();
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (port, spans)
}

fn attributes(list: &Value) -> HashMap<String, String> {
    list.as_array()
        .into_iter()
        .flatten()
        .filter_map(|a| {
            Some((
                a["key"].as_str()?.to_owned(),
                a["value"]["stringValue"].as_str()?.to_owned(),
            ))
        })
        .collect()
}

/// The spans of an `ExportTraceServiceRequest`.
fn spans_of(request: &Value) -> Vec<Span> {
    let mut out = Vec::new();
    for resource in request["resourceSpans"].as_array().into_iter().flatten() {
        let service = attributes(&resource["resource"]["attributes"])
            .remove("service.name")
            .unwrap_or_default();
        for scope in resource["scopeSpans"].as_array().into_iter().flatten() {
            for span in scope["spans"].as_array().into_iter().flatten() {
                out.push((
                    service.clone(),
                    span["traceId"].as_str().unwrap_or_default().to_lowercase(),
                    span["name"].as_str().unwrap_or_default().to_owned(),
                    attributes(&span["attributes"]),
                ));
            }
        }
    }
    out
}

/// A system whose scheduler, agents and supervisor export their spans to
/// the collector on `port`; the processes run while it lives.
struct Traced {
    publisher: sas_broker::Publisher,
    sim: sas_tests::sim::SimClient,
    _processes: Vec<sas_tests::process::Service>,
    _connection: sas_broker::lapin::Connection,
}

impl Traced {
    async fn start(env: &TestEnv, port: u16) -> Self {
        let otlp = [Setting::LogOtlpEndpoint(format!("http://127.0.0.1:{port}"))];
        let (connection, publisher) = env.broker().await;
        let (sim_process, sim) = env.remote_sim(&[]).await;
        let mut processes = env.agents(1, &sim, &otlp);
        processes.push(sim_process);
        processes.push(env.scheduler(0, &otlp));
        processes.push(env.supervisor(0, &otlp));
        Self {
            publisher,
            sim,
            _processes: processes,
            _connection: connection,
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn each_order_is_one_trace_across_every_service_and_reaches_the_remote() {
    let (port, spans) = receiver().await;
    let env = TestEnv::new().await;
    let system = Traced::start(&env, port).await;
    let (publisher, sim) = (&system.publisher, &system.sim);
    let mut declined = order("ord-trace-declined");
    declined.amount_cents = 50_000_000;
    env.publish_order(publisher, &order("ord-trace-ok")).await;
    env.publish_order(publisher, &declined).await;
    for (id, state) in [
        ("ord-trace-ok", ProcessState::Processed),
        ("ord-trace-declined", ProcessState::Compensated),
    ] {
        env.wait_for_state(id, state, Duration::from_secs(30)).await;
    }
    let trace_of = |id: &'static str| {
        let pool = env.db.clone();
        async move {
            sqlx::query_scalar::<_, String>(
                "SELECT trace_id FROM order_process WHERE order_id = $1",
            )
            .bind(id)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    let traces = [
        ("ord-trace-ok", trace_of("ord-trace-ok").await, 3),
        (
            "ord-trace-declined",
            trace_of("ord-trace-declined").await,
            2,
        ),
    ];
    assert_ne!(
        traces[0].1, traces[1].1,
        "each order has a trace of its own"
    );

    for (id, trace, calls) in &traces {
        // Intake, a dispatch and a reply per attempt from the scheduler; a
        // step and a call per attempt from the agents, all in the order's trace.
        wait_until(
            &format!("the spans of {id}"),
            Duration::from_secs(30),
            || async {
                let spans = spans.lock().unwrap();
                let names: HashSet<(String, String)> = spans
                    .iter()
                    .filter(|(_, t, _, _)| t == trace)
                    .map(|(service, _, name, _)| (service.clone(), name.clone()))
                    .collect();
                let calls_seen = spans
                    .iter()
                    .filter(|(service, t, name, _)| {
                        t == trace && service == "agent" && name == "call"
                    })
                    .count();
                let wanted = [
                    ("scheduler", "intake"),
                    ("scheduler", "dispatch"),
                    ("scheduler", "reply"),
                    ("agent", "step"),
                    ("agent", "call"),
                ];
                let missing: Vec<_> = wanted
                    .iter()
                    .filter(|(s, n)| !names.contains(&((*s).to_owned(), (*n).to_owned())))
                    .collect();
                if missing.is_empty() && calls_seen >= *calls {
                    Ok(())
                } else {
                    Err(format!(
                        "missing {missing:?}, {calls_seen} calls; seen {names:?}"
                    ))
                }
            },
        )
        .await;
        // Every span that names the order is in its trace: one trace per order.
        let spans = spans.lock().unwrap();
        let strays: Vec<_> = spans
            .iter()
            .filter(|(_, t, _, attrs)| {
                attrs.get("order_id") == Some(&(*id).to_owned()) && t != trace
            })
            .collect();
        assert!(
            strays.is_empty(),
            "{id}: spans outside its trace: {strays:?}"
        );
    }
    // The compensation is in the declined order's trace: the agent's undo.
    let undone = spans
        .lock()
        .unwrap()
        .iter()
        .any(|(service, t, name, attrs)| {
            *t == traces[1].1
                && service == "agent"
                && name == "step"
                && attrs.get("action").map(String::as_str) == Some("release")
        });
    assert!(
        undone,
        "the reservation's release is in the declined order's trace"
    );
    // The remote service received each order's trace with every call.
    for entry in sim.side_effects().await.unwrap() {
        let Some(order_id) = entry.order_id.as_deref() else {
            continue;
        };
        let (_, trace, _) = traces
            .iter()
            .find(|(id, _, _)| *id == order_id)
            .expect("an order of this test");
        assert_eq!(entry.trace_id.as_deref(), Some(trace.as_str()), "{entry:?}");
    }
}

/// A collector that accepts connections and never answers (hung, or behind
/// a black-holing proxy) costs spans, never orders: export runs on its own
/// thread with a bounded queue, off the path of every message.
#[tokio::test(flavor = "multi_thread")]
async fn a_collector_that_never_answers_holds_up_no_order() {
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0))
        .await
        .unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((connection, _)) = listener.accept().await {
            held.push(connection);
        }
    });
    let env = TestEnv::new().await;
    let system = Traced::start(&env, port).await;
    let publisher = &system.publisher;
    env.publish_orders(publisher, "ord-hung-collector", 20)
        .await;
    env.wait_for_count(ProcessState::Processed, 20, Duration::from_secs(30))
        .await;
    assert_eq!(env.count(ProcessState::Compensated).await, 0);
}
