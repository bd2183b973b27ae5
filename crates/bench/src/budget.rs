//! The latency budget: where an order's time goes, line by line along its
//! path, from the services' own histograms.
//!
//! Every stage an order passes is timed where it happens and recorded in a
//! histogram on the service's `/metrics` page: the wait in each queue
//! (from the `x-sas-published-at` header to the delivery), each batch's
//! wait and statement, each publish with its confirms, the agent's remote
//! call and its own time, a wait in an admission line. The benchmark reads
//! every page before and after the latency phase; the differences of each
//! histogram's `_sum` and `_count`, divided by the phase's orders, say how
//! many milliseconds of an order's latency the stage took, how often an
//! order met it, and how long it took each time.
//!
//! The lines on the path add up to about the mean latency; what they do
//! not account for (decoding, task switches, the client's own publish) is
//! reported as its own line, so a gap shows rather than hides.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::drive::metrics_page;

/// One line of the budget.
#[derive(Debug, Clone, Serialize)]
pub struct BudgetLine {
    /// What the time was spent on.
    pub stage: String,
    /// Whether it adds to an order's latency (false: a confirm or an ack
    /// awaited after the order has moved on, which holds a prefetch slot
    /// rather than the order).
    pub on_path: bool,
    /// Milliseconds of an order's latency, on average.
    pub ms_per_order: f64,
    /// How many times an order met the stage.
    pub times_per_order: f64,
    /// Milliseconds each time, on average.
    pub mean_ms: f64,
}

/// Which process's page a line reads.
#[derive(Debug, Clone, Copy)]
enum Service {
    Scheduler,
    Agents,
}

/// A line read from one histogram (`metric`, its label sets filtered by
/// `label`, summed over the service's processes).
struct Source {
    stage: &'static str,
    service: Service,
    metric: &'static str,
    label: Option<(&'static str, String)>,
    on_path: bool,
}

/// `_sum` and `_count` of every histogram sample on some pages, by metric
/// name and label set.
#[derive(Debug, Default, Clone)]
pub struct Histograms(BTreeMap<(String, String), (f64, f64)>);

impl Histograms {
    /// Reads and adds up the `/metrics` pages on `ports`.
    async fn read(ports: &[u16]) -> Self {
        let mut all = Self::default();
        for &port in ports {
            all.add(&metrics_page(port).await);
        }
        all
    }

    /// Adds the histograms of one Prometheus text page.
    fn add(&mut self, page: &str) {
        for line in page.lines().filter(|line| !line.starts_with('#')) {
            let Some((series, value)) = line.rsplit_once(' ') else {
                continue;
            };
            let Ok(value) = value.parse::<f64>() else {
                continue;
            };
            let (name, labels) = match series.split_once('{') {
                Some((name, labels)) => (name, labels.trim_end_matches('}')),
                None => (series, ""),
            };
            let (metric, is_sum) = if let Some(metric) = name.strip_suffix("_sum") {
                (metric, true)
            } else if let Some(metric) = name.strip_suffix("_count") {
                (metric, false)
            } else {
                continue;
            };
            let entry = self
                .0
                .entry((metric.to_owned(), labels.to_owned()))
                .or_default();
            if is_sum {
                entry.0 += value;
            } else {
                entry.1 += value;
            }
        }
    }

    /// (sum, count) of `metric` over the label sets that carry `label`.
    fn total(&self, metric: &str, label: Option<&(&str, String)>) -> (f64, f64) {
        self.0
            .iter()
            .filter(|((name, labels), _)| {
                name == metric
                    && label.is_none_or(|(key, value)| {
                        labels
                            .split(',')
                            .any(|pair| pair == format!("{key}=\"{value}\""))
                    })
            })
            .fold((0.0, 0.0), |(sum, count), (_, (s, c))| (sum + s, count + c))
    }
}

/// The histograms of the scheduler and of the agents at one moment.
#[derive(Debug, Clone)]
pub struct Reading {
    scheduler: Histograms,
    agents: Histograms,
}

impl Reading {
    /// Reads the scheduler's page and every agent's.
    pub async fn take(scheduler_port: u16, agent_ports: &[u16]) -> Self {
        Self {
            scheduler: Histograms::read(&[scheduler_port]).await,
            agents: Histograms::read(agent_ports).await,
        }
    }

    /// Mean of the scheduler's histogram `metric` labelled `batch = batch`
    /// between `before` and this reading (0 when nothing was recorded).
    pub fn scheduler_batch_mean(&self, before: &Self, metric: &str, batch: &str) -> f64 {
        let label = ("batch", batch.to_owned());
        let (sum, count) = self.scheduler.total(metric, Some(&label));
        let (sum_before, count_before) = before.scheduler.total(metric, Some(&label));
        if count > count_before {
            (sum - sum_before) / (count - count_before)
        } else {
            0.0
        }
    }

    fn of(&self, service: Service) -> &Histograms {
        match service {
            Service::Scheduler => &self.scheduler,
            Service::Agents => &self.agents,
        }
    }
}

/// What the benchmark measured itself: the status queue's wait for each
/// order's `processed` status, and the mean end-to-end latency.
pub struct ClientSide {
    /// Sum of the `processed` statuses' waits in the client's queue, ms.
    pub status_wait_ms: f64,
    /// How many of them carried the header.
    pub statuses: usize,
    /// Mean publish-to-`processed` latency, ms.
    pub mean_latency_ms: f64,
}

/// The budget of `orders` orders that ran between `before` and `after`,
/// with `queues` naming the order and reply queues.
pub fn budget(
    before: &Reading,
    after: &Reading,
    orders: usize,
    queues: (&str, &str),
    client: &ClientSide,
) -> Vec<BudgetLine> {
    let orders = orders.max(1) as f64;
    let (orders_queue, replies_queue) = (queues.0.to_owned(), queues.1.to_owned());
    let delta = |service: Service, metric: &str, label: Option<&(&str, String)>| {
        let (sum_after, count_after) = after.of(service).total(metric, label);
        let (sum_before, count_before) = before.of(service).total(metric, label);
        (sum_after - sum_before, count_after - count_before)
    };
    let line = |stage: &str, on_path: bool, (sum_secs, count): (f64, f64)| BudgetLine {
        stage: stage.to_owned(),
        on_path,
        ms_per_order: sum_secs * 1000.0 / orders,
        times_per_order: count / orders,
        mean_ms: if count > 0.0 {
            sum_secs * 1000.0 / count
        } else {
            0.0
        },
    };
    let (mut lines, off_path): (Vec<BudgetLine>, Vec<BudgetLine>) =
        sources(orders_queue, replies_queue)
            .into_iter()
            .map(|source| {
                let measured = delta(source.service, source.metric, source.label.as_ref());
                line(source.stage, source.on_path, measured)
            })
            .partition(|line| line.on_path);
    // The agent's own time: its whole handling less the remote call.
    let (handled, handled_count) = delta(Service::Agents, "sas_agent_step_duration_seconds", None);
    let (remote, _) = delta(Service::Agents, "sas_agent_remote_seconds", None);
    let after_remote = lines
        .iter()
        .position(|l| l.stage.starts_with("agent: remote"))
        .map_or(lines.len(), |i| i + 1);
    lines.insert(
        after_remote,
        line(
            "agent: own time around the call",
            true,
            (handled - remote, handled_count),
        ),
    );
    lines.push(line(
        "status queue: scheduler to client",
        true,
        (client.status_wait_ms / 1000.0, client.statuses as f64),
    ));
    let accounted: f64 = lines.iter().map(|l| l.ms_per_order).sum();
    lines.push(BudgetLine {
        stage: "not accounted for (mean latency less the lines above)".to_owned(),
        on_path: true,
        ms_per_order: client.mean_latency_ms - accounted,
        times_per_order: 1.0,
        mean_ms: client.mean_latency_ms - accounted,
    });
    lines.extend(off_path);
    lines
}

/// The lines read from the services' histograms, in the order an order
/// meets them (the agent's own time and the client's status queue are
/// added by [`budget`]).
fn sources(orders_queue: String, replies_queue: String) -> Vec<Source> {
    let batch = |name: &str| Some(("batch", name.to_owned()));
    vec![
        Source {
            stage: "order queue: client to scheduler",
            service: Service::Scheduler,
            metric: "sas_queue_wait_seconds",
            label: Some(("queue", orders_queue)),
            on_path: true,
        },
        Source {
            stage: "intake: wait for a batch",
            service: Service::Scheduler,
            metric: "sas_batch_wait_seconds",
            label: batch("intake"),
            on_path: true,
        },
        Source {
            stage: "intake: statement and commit",
            service: Service::Scheduler,
            metric: "sas_batch_run_seconds",
            label: batch("intake"),
            on_path: true,
        },
        Source {
            stage: "admission: wait in a line",
            service: Service::Scheduler,
            metric: "sas_admission_wait_seconds",
            label: None,
            on_path: true,
        },
        Source {
            stage: "scheduler: confirms of what it published (holds the delivery)",
            service: Service::Scheduler,
            metric: "sas_publish_seconds",
            label: None,
            on_path: false,
        },
        Source {
            stage: "request queue: scheduler to agent",
            service: Service::Agents,
            metric: "sas_queue_wait_seconds",
            label: None,
            on_path: true,
        },
        Source {
            stage: "agent: remote call",
            service: Service::Agents,
            metric: "sas_agent_remote_seconds",
            label: None,
            on_path: true,
        },
        Source {
            stage: "agent: confirm of its reply (holds the delivery)",
            service: Service::Agents,
            metric: "sas_publish_seconds",
            label: None,
            on_path: false,
        },
        Source {
            stage: "reply queue: agent to scheduler",
            service: Service::Scheduler,
            metric: "sas_queue_wait_seconds",
            label: Some(("queue", replies_queue)),
            on_path: true,
        },
        Source {
            stage: "replies: wait for a batch",
            service: Service::Scheduler,
            metric: "sas_batch_wait_seconds",
            label: batch("replies"),
            on_path: true,
        },
        Source {
            stage: "replies: statement and commit",
            service: Service::Scheduler,
            metric: "sas_batch_run_seconds",
            label: batch("replies"),
            on_path: true,
        },
        Source {
            stage: "scheduler: ack held after the work",
            service: Service::Scheduler,
            metric: "sas_ack_delay_seconds",
            label: None,
            on_path: false,
        },
        Source {
            stage: "agent: ack held after the work",
            service: Service::Agents,
            metric: "sas_ack_delay_seconds",
            label: None,
            on_path: false,
        },
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: &str = "\
# TYPE sas_queue_wait_seconds histogram
sas_queue_wait_seconds_bucket{queue=\"t.sas.orders\",le=\"0.001\"} 1
sas_queue_wait_seconds_sum{queue=\"t.sas.orders\"} 0.5
sas_queue_wait_seconds_count{queue=\"t.sas.orders\"} 100
sas_queue_wait_seconds_sum{queue=\"t.sas.replies\"} 0.9
sas_queue_wait_seconds_count{queue=\"t.sas.replies\"} 300
sas_publish_seconds_sum 1.2
sas_publish_seconds_count 400
";

    #[test]
    fn sums_and_counts_are_read_by_metric_and_label() {
        let mut page = Histograms::default();
        page.add(PAGE);
        let orders = ("queue", "t.sas.orders".to_owned());
        assert_eq!(
            page.total("sas_queue_wait_seconds", Some(&orders)),
            (0.5, 100.0)
        );
        let (sum, count) = page.total("sas_queue_wait_seconds", None);
        assert!((sum - 1.4).abs() < 1e-9 && (count - 400.0).abs() < 1e-9);
        assert_eq!(page.total("sas_publish_seconds", None), (1.2, 400.0));
        assert_eq!(page.total("sas_missing_seconds", None), (0.0, 0.0));
    }

    #[test]
    fn a_line_is_the_difference_per_order_and_the_gap_is_its_own_line() {
        let before = Reading {
            scheduler: Histograms::default(),
            agents: Histograms::default(),
        };
        let mut scheduler = Histograms::default();
        scheduler.add(PAGE);
        let after = Reading {
            scheduler,
            agents: Histograms::default(),
        };
        let client = ClientSide {
            status_wait_ms: 100.0,
            statuses: 100,
            mean_latency_ms: 20.0,
        };
        let lines = budget(
            &before,
            &after,
            100,
            ("t.sas.orders", "t.sas.replies"),
            &client,
        );
        let get = |stage: &str| {
            lines
                .iter()
                .find(|l| l.stage.starts_with(stage))
                .unwrap_or_else(|| panic!("no line {stage}"))
        };
        let orders = get("order queue");
        assert!((orders.ms_per_order - 5.0).abs() < 1e-9);
        assert!((orders.times_per_order - 1.0).abs() < 1e-9);
        let replies = get("reply queue");
        assert!((replies.ms_per_order - 9.0).abs() < 1e-9);
        assert!((replies.mean_ms - 3.0).abs() < 1e-9);
        // A publisher's confirm overlaps the queue wait: off the path.
        let confirms = get("scheduler: confirms");
        assert!(!confirms.on_path && (confirms.ms_per_order - 12.0).abs() < 1e-9);
        assert!((get("status queue").ms_per_order - 1.0).abs() < 1e-9);
        // 20 ms of latency, 5 + 9 + 1 = 15 on the path: 5 not accounted for.
        assert!((get("not accounted").ms_per_order - 5.0).abs() < 1e-9);
    }
}
