//! `sas-console-bench`: response times of the console's list and filter
//! pages over a large state store (`scripts/bench.sh console`).
//!
//! It makes its own database, fills it with orders straight in SQL (the
//! shape intake writes: the order, its process record, three steps; a
//! spread of states, customers, priorities, failures and submission times),
//! starts the real `console` binary on it, and for each size asks each
//! page a number of times, one request at a time, recording p50 and p99.
//! Sizes grow in place (100,000, then 900,000 more for 1,000,000), with
//! `ANALYZE` after each fill, as autovacuum would.

use std::path::Path;
use std::time::Instant;

use clap::Parser;
use sas_lab::console::{As, ConsoleClient};
use sas_lab::TestEnv;
use serde::Serialize;

/// Measures the console's list and filter pages at growing numbers of orders.
#[derive(Debug, Parser)]
#[command(version, about, long_about = None)]
struct Cli {
    /// Order counts to measure at, ascending (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "100000,1000000")]
    orders: Vec<u64>,
    /// Requests per page and size.
    #[arg(long, default_value_t = 200)]
    requests: usize,
    /// A small run (2,000 orders, 10 requests), for the tests.
    #[arg(long)]
    quick: bool,
    /// Where to write the JSON report.
    #[arg(long, default_value = "target/bench/console.json")]
    out: std::path::PathBuf,
}

/// One page at one size.
#[derive(Debug, Serialize)]
struct Measured {
    orders: u64,
    page: &'static str,
    path: String,
    rows: usize,
    p50_ms: f64,
    p99_ms: f64,
}

/// The pages measured: (name, path). `{deep}` is replaced by the cursor
/// found by walking 20 pages.
const PAGES: [(&str, &str); 10] = [
    ("list, first page (HTML)", "/orders"),
    ("list, first page (JSON)", "/api/orders"),
    ("list, 21st page (keyset)", "/api/orders?after={deep}"),
    ("state=error", "/api/orders?state=error"),
    ("state=processing (HTML)", "/orders?state=processing"),
    ("customer", "/api/orders?customer=cust-42"),
    ("id prefix", "/api/orders?id=ord-00000001"),
    ("current step", "/api/orders?step=charge_payment"),
    (
        "failures and priority",
        "/api/orders?min_failures=3&priority=3",
    ),
    ("time range", "/api/orders?from={from}&to={to}"),
];

/// Fills orders `from..to` (ids `ord-<10 digits>`), one statement per table.
async fn fill(env: &TestEnv, from: u64, to: u64) -> anyhow::Result<()> {
    let pool = &env.db;
    let (from, to) = (from as i64, to as i64);
    sqlx::query(
        "INSERT INTO orders (order_id, body, received_at)
         SELECT 'ord-' || lpad(i::text, 10, '0'),
                jsonb_build_object('schema_version', 1, 'order_id', 'ord-' || lpad(i::text, 10, '0'),
                    'customer_id', 'cust-' || (i % 10000),
                    'items', jsonb_build_array(jsonb_build_object('sku', 'SKU-1', 'quantity', 1)),
                    'amount_cents', 1999, 'currency', 'EUR'),
                now() - interval '1 day' + i * interval '50 ms'
           FROM generate_series($1::bigint, $2::bigint - 1) i",
    )
    .bind(from)
    .bind(to)
    .execute(pool)
    .await?;
    // 90% processed, 5% compensated, 3% error, 2% in flight at the payment step.
    sqlx::query(
        "INSERT INTO order_process (order_id, workflow, state, failure_count, priority,
                                    created_at, updated_at, locked_by, last_error)
         SELECT o.order_id, 'order', s.state::process_state,
                CASE WHEN s.state IN ('error', 'compensated') THEN (n % 6) ELSE 0 END,
                (n % 10)::smallint, o.received_at, o.received_at,
                CASE WHEN s.state = 'processing' THEN 'scheduler-1' END,
                CASE WHEN s.state IN ('error', 'compensated') THEN 'payment declined' END
           FROM (SELECT order_id, received_at, substr(order_id, 5)::bigint AS n FROM orders
                  WHERE order_id >= 'ord-' || lpad($1::text, 10, '0')
                    AND order_id < 'ord-' || lpad($2::text, 10, '0')) o
           CROSS JOIN LATERAL (SELECT CASE WHEN n % 100 < 90 THEN 'processed'
                                           WHEN n % 100 < 95 THEN 'compensated'
                                           WHEN n % 100 < 98 THEN 'error'
                                           ELSE 'processing' END AS state) s",
    )
    .bind(from)
    .bind(to)
    .execute(pool)
    .await?;
    sqlx::query(
        "INSERT INTO steps (order_id, position, name, agent, action, compensation, timeout_ms,
                            state, attempt, idempotency_key)
         SELECT p.order_id, w.position, w.name, w.agent, w.action, w.compensation, 3000,
                (CASE
                   WHEN p.state = 'processed' THEN 'completed'
                   WHEN p.state = 'processing' AND w.position = 0 THEN 'completed'
                   WHEN p.state = 'processing' AND w.position = 1 THEN 'running'
                   WHEN p.state IN ('compensated', 'error') AND w.position = 0 THEN 'compensated'
                   WHEN p.state IN ('compensated', 'error') AND w.position = 1 THEN 'failed'
                   ELSE 'not_started' END)::step_state,
                1, p.order_id || ':' || w.name
           FROM order_process p
           CROSS JOIN (VALUES (0, 'reserve_stock', 'inventory', 'reserve', 'release'),
                              (1, 'charge_payment', 'payment', 'charge', 'refund'),
                              (2, 'create_shipment', 'shipping', 'ship', 'cancel'))
                AS w(position, name, agent, action, compensation)
          WHERE p.order_id >= 'ord-' || lpad($1::text, 10, '0')
            AND p.order_id < 'ord-' || lpad($2::text, 10, '0')",
    )
    .bind(from)
    .bind(to)
    .execute(pool)
    .await?;
    sqlx::query("ANALYZE").execute(pool).await?;
    Ok(())
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let index = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[index.min(sorted.len() - 1)]
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let (sizes, requests) = sizes_and_requests(&cli)?;
    let env = TestEnv::new().await;
    let (_process, console) = env.console(&[]).await;
    let mut measured = Vec::new();
    let mut filled = 0u64;
    for &size in &sizes {
        fill_to(&env, filled, size).await?;
        filled = size;
        for (name, path) in page_paths(&env, &console, size).await? {
            measured.push(measure(&console, size, name, path, requests).await?);
        }
    }
    print_table(&measured);
    write_report(&cli.out, &measured)
}

/// The sizes and the requests per page of this run (`--quick` overrides
/// both), checked.
fn sizes_and_requests(cli: &Cli) -> anyhow::Result<(Vec<u64>, usize)> {
    let (sizes, requests) = if cli.quick {
        (vec![2_000], 10)
    } else {
        (cli.orders.clone(), cli.requests)
    };
    anyhow::ensure!(
        sizes.windows(2).all(|w| w[0] < w[1]) && !sizes.is_empty(),
        "--orders must be ascending"
    );
    anyhow::ensure!(requests > 0, "--requests must be positive");
    Ok((sizes, requests))
}

/// Grows the store from `filled` to `size` orders, 100,000 at a time, and
/// says how long it took.
async fn fill_to(env: &TestEnv, filled: u64, size: u64) -> anyhow::Result<()> {
    let started = Instant::now();
    for from in (filled..size).step_by(100_000) {
        fill(env, from, (from + 100_000).min(size)).await?;
    }
    eprintln!(
        "{size} orders stored in {:.1}s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Each of [`PAGES`] with its path at this size: the cursor 20 pages down,
/// and a 10-minute range in the middle of the day, filled in.
async fn page_paths(
    env: &TestEnv,
    console: &ConsoleClient,
    size: u64,
) -> anyhow::Result<Vec<(&'static str, String)>> {
    let mut deep = String::new();
    for _ in 0..20 {
        let page: serde_json::Value = console
            .get(&format!("/api/orders?after={deep}"), As::Viewer)
            .await
            .json()
            .await?;
        deep = page["next"].as_str().unwrap_or_default().to_owned();
    }
    let middle: chrono::DateTime<chrono::Utc> = sqlx::query_scalar(
        "SELECT created_at FROM order_process ORDER BY created_at OFFSET $1 LIMIT 1",
    )
    .bind((size / 2) as i64)
    .fetch_one(&env.db)
    .await?;
    let encode = |t: chrono::DateTime<chrono::Utc>| t.format("%Y-%m-%dT%H:%M:%SZ").to_string();
    Ok(PAGES
        .into_iter()
        .map(|(name, template)| {
            let path = template
                .replace("{deep}", &deep)
                .replace("{from}", &encode(middle))
                .replace("{to}", &encode(middle + chrono::Duration::minutes(10)));
            (name, path)
        })
        .collect())
}

/// Asks the page at `path` `requests` times, one request at a time: its
/// p50 and p99, and the rows it shows.
async fn measure(
    console: &ConsoleClient,
    orders: u64,
    page: &'static str,
    path: String,
    requests: usize,
) -> anyhow::Result<Measured> {
    let mut times = Vec::with_capacity(requests);
    let mut rows = 0;
    for _ in 0..requests {
        let started = Instant::now();
        let response = console.get(&path, As::Viewer).await;
        anyhow::ensure!(
            response.status().is_success(),
            "{path}: {}",
            response.status()
        );
        let body = response.text().await?;
        times.push(started.elapsed().as_secs_f64() * 1000.0);
        rows = rows_shown(&path, &body)?;
    }
    times.sort_by(f64::total_cmp);
    Ok(Measured {
        orders,
        page,
        path,
        rows,
        p50_ms: percentile(&times, 0.5),
        p99_ms: percentile(&times, 0.99),
    })
}

/// The orders a page shows: the JSON's `orders`, or the HTML's order rows.
fn rows_shown(path: &str, body: &str) -> anyhow::Result<usize> {
    Ok(if path.starts_with("/api/") {
        serde_json::from_str::<serde_json::Value>(body)?["orders"]
            .as_array()
            .map_or(0, Vec::len)
    } else {
        body.matches("data-order=").count()
    })
}

/// Prints the measurements as a Markdown table.
fn print_table(measured: &[Measured]) {
    println!("| orders | page | rows | p50 ms | p99 ms |\n|---|---|---|---|---|");
    for m in measured {
        println!(
            "| {} | {} | {} | {:.1} | {:.1} |",
            m.orders, m.page, m.rows, m.p50_ms, m.p99_ms
        );
    }
}

/// Writes the measurements as JSON to `out`, making its folder first.
fn write_report(out: &Path, measured: &[Measured]) -> anyhow::Result<()> {
    if let Some(folder) = out.parent() {
        std::fs::create_dir_all(folder)?;
    }
    std::fs::write(out, serde_json::to_string_pretty(measured)?)?;
    Ok(())
}
