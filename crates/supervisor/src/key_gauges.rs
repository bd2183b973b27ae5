//! The gauges of the workflows' key lines, and forgetting the keys no
//! longer limited (see the store's
//! `machine::concurrency`): unlabelled totals for every key
//! (`sas_key_lines_waiting`: orders waiting in key lines;
//! `sas_keys_paused`: keys their remotes asked to rest), and gauges labelled
//! with the key only for the keys `supervisor.key_metrics` names, since a
//! label per merchant could be a million series.

use std::collections::BTreeSet;

use crate::Supervisor;

/// The most ended pauses and quiet rates forgotten a scan.
const FORGET_AT_ONCE: i32 = 1000;

/// The most labelled key lines exported at once.
const MOST_LABELLED: i64 = 1000;

impl Supervisor {
    /// Exports the key lines' gauges. A labelled key that went idle (no
    /// state, so not read back) is set to zero rather than left at its
    /// last value.
    pub(crate) async fn export_key_gauges(&self) {
        let admission = self.store.admission();
        // What no key needs any more: ended pauses, rates quiet for a
        // minute (the services' role may not DELETE; this function may).
        if let Err(error) = admission.forget_quiet_keys(FORGET_AT_ONCE).await {
            tracing::debug!(error = %error, "cannot forget quiet keys");
        }
        match admission.key_totals().await {
            Ok((waiting, paused)) => {
                metrics::gauge!("sas_key_lines_waiting").set(waiting as f64);
                metrics::gauge!("sas_keys_paused").set(paused as f64);
            }
            Err(error) => tracing::debug!(error = %error, "cannot read the key lines' totals"),
        }
        let prefixes = self.settings.supervisor.key_metric_prefixes();
        if prefixes.is_empty() {
            return;
        }
        let lines = match admission.key_lines_starting(&prefixes, MOST_LABELLED).await {
            Ok(lines) => lines,
            Err(error) => {
                tracing::debug!(error = %error, "cannot read the labelled key lines");
                return;
            }
        };
        let now: BTreeSet<String> = lines.iter().map(|line| line.key.clone()).collect();
        for line in lines {
            let key = line.key;
            metrics::gauge!("sas_key_waiting", "key" => key.clone()).set(line.waiting as f64);
            metrics::gauge!("sas_key_in_flight", "key" => key.clone()).set(line.in_flight as f64);
            // The limit in force: what an adaptive key learnt, or the declared one.
            let limit = line.learnt_limit.or(line.limit).unwrap_or(0);
            metrics::gauge!("sas_key_limit", "key" => key.clone()).set(f64::from(limit));
            let paused = line
                .paused_until
                .map_or(0.0, |until| until.timestamp() as f64);
            metrics::gauge!("sas_key_paused_until_seconds", "key" => key).set(paused);
        }
        let mut exported = self.labelled_keys.lock().unwrap_or_else(|e| e.into_inner());
        for idle in exported.difference(&now) {
            for name in [
                "sas_key_waiting",
                "sas_key_in_flight",
                "sas_key_limit",
                "sas_key_paused_until_seconds",
            ] {
                metrics::gauge!(name, "key" => idle.clone()).set(0.0);
            }
        }
        *exported = now;
    }
}
