//! Group commit: many concurrent callers, one statement for all of them.
//!
//! Each message handler runs on its own task and would otherwise pay one
//! database round trip and one commit per message. A [`Batcher`] queues the
//! callers' items and lets a few workers take whatever has queued up (up to
//! `max` items) as one batch: one item when the system is idle, so latency
//! does not suffer, and many under load, where it pays off. Nothing waits
//! for a batch to fill.

use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::{mpsc, oneshot, Mutex};

/// A queue of items that workers handle in batches; see the module docs.
pub struct Batcher<I, O> {
    queue: mpsc::UnboundedSender<Queued<I, O>>,
}

/// An item, when it was queued, and where its output goes.
type Queued<I, O> = (I, Instant, oneshot::Sender<O>);

impl<I, O> Clone for Batcher<I, O> {
    fn clone(&self) -> Self {
        Self {
            queue: self.queue.clone(),
        }
    }
}

impl<I: Send + 'static, O: Send + 'static> Batcher<I, O> {
    /// Starts `workers` tasks that call `run` on batches of at most `max`
    /// items; `run` returns one output per item, in the items' order.
    ///
    /// The workers stop once every clone of the batcher is dropped and the
    /// queue is empty.
    ///
    /// Each batch is counted in the `sas_batch_items` and `sas_batch_seconds`
    /// histograms, and each item in `sas_batch_wait_seconds` (from its
    /// queueing to its batch's start) and `sas_batch_run_seconds` (its
    /// batch's run, which it waited for whole), labelled `batch = name`.
    pub fn spawn<F, Fut>(name: &'static str, max: usize, workers: usize, run: F) -> Self
    where
        F: Fn(Vec<I>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Vec<O>> + Send + 'static,
    {
        let (queue, receiver) = mpsc::unbounded_channel::<Queued<I, O>>();
        let receiver = Arc::new(Mutex::new(receiver));
        let run = Arc::new(run);
        let max = max.max(1);
        for _ in 0..workers.max(1) {
            let (receiver, run) = (receiver.clone(), run.clone());
            tokio::spawn(async move {
                loop {
                    let mut batch = Vec::new();
                    {
                        // One worker at a time collects; the others run
                        // their batches meanwhile.
                        let mut receiver = receiver.lock().await;
                        if receiver.recv_many(&mut batch, max).await == 0 {
                            return;
                        }
                    }
                    let started = Instant::now();
                    let wait = metrics::histogram!("sas_batch_wait_seconds", "batch" => name);
                    let (items, replies): (Vec<I>, Vec<oneshot::Sender<O>>) = batch
                        .into_iter()
                        .map(|(item, queued, reply)| {
                            wait.record((started - queued).as_secs_f64());
                            (item, reply)
                        })
                        .unzip();
                    metrics::histogram!("sas_batch_items", "batch" => name)
                        .record(items.len() as f64);
                    // A panic in one batch fails that batch's callers (their
                    // messages go back to the queue), not the worker.
                    let Ok(outputs) = futures_util::FutureExt::catch_unwind(
                        std::panic::AssertUnwindSafe(run(items)),
                    )
                    .await
                    else {
                        tracing::error!(batch = name, "a batch panicked; its callers retry");
                        continue;
                    };
                    let took = started.elapsed().as_secs_f64();
                    metrics::histogram!("sas_batch_seconds", "batch" => name).record(took);
                    // Every caller waited for the whole batch.
                    let run = metrics::histogram!("sas_batch_run_seconds", "batch" => name);
                    for _ in 0..replies.len() {
                        run.record(took);
                    }
                    debug_assert_eq!(outputs.len(), replies.len());
                    for (reply, output) in replies.into_iter().zip(outputs) {
                        // The caller may have given up (shutdown): nothing to tell.
                        let _ = reply.send(output);
                    }
                }
            });
        }
        Self { queue }
    }

    /// Queues `item` and waits for its output; `None` only when the workers
    /// are gone (the runtime is shutting down).
    pub async fn submit(&self, item: I) -> Option<O> {
        let (reply, output) = oneshot::channel();
        self.queue.send((item, Instant::now(), reply)).ok()?;
        output.await.ok()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn callers_waiting_together_share_a_batch_and_get_their_own_output() {
        let batches = Arc::new(AtomicUsize::new(0));
        let counted = batches.clone();
        let batcher = Batcher::spawn("test", 8, 1, move |items: Vec<u32>| {
            let counted = counted.clone();
            async move {
                counted.fetch_add(1, Ordering::SeqCst);
                // Slow enough that the other callers queue up behind the first.
                tokio::time::sleep(Duration::from_millis(50)).await;
                items.into_iter().map(|item| item * 10).collect()
            }
        });
        let outputs = futures_util::future::join_all((0..20).map(|i| batcher.submit(i))).await;
        assert_eq!(
            outputs,
            (0..20).map(|i| Some(i * 10)).collect::<Vec<_>>(),
            "each caller gets the output of its own item"
        );
        let batches = batches.load(Ordering::SeqCst);
        assert!(
            (3..20).contains(&batches),
            "20 items in batches of at most 8 take 3 or more batches but far fewer than 20, took {batches}"
        );
    }

    #[tokio::test]
    async fn a_batch_that_panics_fails_its_callers_and_the_worker_goes_on() {
        let batcher = Batcher::spawn("test", 8, 1, |items: Vec<u32>| async move {
            assert!(!items.contains(&13), "unlucky");
            items
        });
        assert_eq!(
            batcher.submit(13).await,
            None,
            "the panicking batch's caller gets nothing"
        );
        assert_eq!(
            tokio::time::timeout(Duration::from_secs(1), batcher.submit(7)).await,
            Ok(Some(7)),
            "the only worker still serves"
        );
    }

    #[tokio::test]
    async fn a_lone_caller_does_not_wait_for_a_batch_to_fill() {
        let batcher = Batcher::spawn("test", 64, 2, |items: Vec<u32>| async move { items });
        let output = tokio::time::timeout(Duration::from_secs(1), batcher.submit(7)).await;
        assert_eq!(output, Ok(Some(7)));
    }
}
