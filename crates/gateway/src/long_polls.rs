//! At most `gateway.max_long_polls_per_client` waiting reads
//! (`GET /v1/orders/{id}?wait=SECONDS`) per client at once: each holds a
//! connection, a task and a store read every quarter second for up to
//! `gateway.max_wait_secs`, so one client opening thousands would starve
//! the others. Past the cap a waiting read is refused (429) at once; a read
//! without `wait` is never counted.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// The waiting reads of each client.
#[derive(Debug)]
pub struct LongPolls {
    per_client: usize,
    open: Arc<Mutex<HashMap<String, usize>>>,
}

/// One waiting read let in; dropped (answered, or its connection gone), it
/// frees its place.
#[derive(Debug)]
pub struct LongPoll {
    client: String,
    open: Arc<Mutex<HashMap<String, usize>>>,
}

impl LongPolls {
    /// At most `per_client` waiting reads per client.
    pub fn new(per_client: usize) -> Self {
        Self {
            per_client,
            open: Arc::default(),
        }
    }

    /// A place for one more waiting read of `client`, or `None` when it
    /// holds `per_client` already.
    pub fn enter(&self, client: &str) -> Option<LongPoll> {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        let count = open.entry(client.to_owned()).or_insert(0);
        if *count >= self.per_client {
            return None;
        }
        *count += 1;
        metrics::gauge!("sas_gateway_long_polls", "client" => client.to_owned()).set(*count as f64);
        Some(LongPoll {
            client: client.to_owned(),
            open: self.open.clone(),
        })
    }
}

impl Drop for LongPoll {
    fn drop(&mut self) {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(count) = open.get_mut(&self.client) {
            *count = count.saturating_sub(1);
            metrics::gauge!("sas_gateway_long_polls", "client" => self.client.clone())
                .set(*count as f64);
            if *count == 0 {
                open.remove(&self.client);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::LongPolls;

    #[test]
    fn each_client_has_its_own_places_and_a_dropped_poll_frees_one() {
        let polls = LongPolls::new(2);
        let first = polls.enter("shop").expect("first");
        let _second = polls.enter("shop").expect("second");
        assert!(polls.enter("shop").is_none(), "a third is refused");
        assert!(polls.enter("rival").is_some(), "another client is not");
        drop(first);
        assert!(
            polls.enter("shop").is_some(),
            "a freed place is taken again"
        );
    }
}
