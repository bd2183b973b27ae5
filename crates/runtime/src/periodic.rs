//! The one periodic loop of the services: the scheduler's claims, the
//! supervisor's scan and its retention.

use std::future::Future;
use std::time::Duration;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// What a periodic task wants after one tick.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// Wait the interval: the tick found less than a full batch.
    Wait,
    /// Tick again at once: the tick's batch came back full, more is due.
    Again,
    /// Wait the interval, or this long if that is sooner: the tick knows
    /// when its next work comes due (a rate-limited line's next start).
    Soon(Duration),
}

impl Next {
    /// [`Next::Again`] when `done` items filled a batch of `batch`.
    pub fn after(done: usize, batch: i64) -> Self {
        if i64::try_from(done).is_ok_and(|done| done >= batch) {
            Self::Again
        } else {
            Self::Wait
        }
    }
}

/// Runs `tick` every `interval` until `shutdown` fires: at once again when
/// it answers [`Next::Again`] (yielding first, so that a busy loop never
/// starves its neighbours), after the interval when it answers
/// [`Next::Wait`]. The tick itself is a plain function that tests can call
/// once, without the loop.
///
/// # Errors
/// The first error a tick returns ends the loop with it.
pub async fn every<E, F, Fut>(
    interval: Duration,
    shutdown: &CancellationToken,
    tick: F,
) -> Result<(), E>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Next, E>>,
{
    every_or_woken(interval, &Notify::new(), shutdown, tick).await
}

/// [`every`], and a [`Next::Wait`] also ends early when `wake` is
/// notified: for a loop whose work something else knows of first (a wake
/// while the tick runs is kept, and the next wait ends at once; several
/// wakes make one tick).
///
/// # Errors
/// The first error a tick returns ends the loop with it.
pub async fn every_or_woken<E, F, Fut>(
    interval: Duration,
    wake: &Notify,
    shutdown: &CancellationToken,
    mut tick: F,
) -> Result<(), E>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Next, E>>,
{
    while !shutdown.is_cancelled() {
        match tick().await? {
            Next::Again => tokio::task::yield_now().await,
            next @ (Next::Wait | Next::Soon(_)) => tokio::select! {
                () = tokio::time::sleep(match next {
                    Next::Soon(due) => due.min(interval),
                    _ => interval,
                }) => {}
                () = wake.notified() => {}
                () = shutdown.cancelled() => {}
            },
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;

    #[test]
    fn a_full_batch_asks_for_another_tick() {
        assert_eq!(Next::after(10, 10), Next::Again);
        assert_eq!(Next::after(9, 10), Next::Wait);
        assert_eq!(Next::after(0, 0), Next::Again);
    }

    #[tokio::test(start_paused = true)]
    async fn ticks_again_at_once_when_full_and_waits_the_interval_otherwise() {
        let shutdown = CancellationToken::new();
        let ticks = AtomicU32::new(0);
        let started = tokio::time::Instant::now();
        every(Duration::from_secs(10), &shutdown, || async {
            let n = ticks.fetch_add(1, Ordering::SeqCst) + 1;
            if n == 4 {
                shutdown.cancel();
            }
            // Two full batches, then a short one, then the last tick.
            Ok::<_, Infallible>(if n <= 2 { Next::Again } else { Next::Wait })
        })
        .await
        .unwrap();
        assert_eq!(ticks.load(Ordering::SeqCst), 4);
        // Only the third tick waited the interval.
        assert_eq!(started.elapsed(), Duration::from_secs(10));
    }

    #[tokio::test(start_paused = true)]
    async fn work_due_soon_shortens_the_wait_never_lengthens_it() {
        let shutdown = CancellationToken::new();
        let ticks = AtomicU32::new(0);
        let started = tokio::time::Instant::now();
        every(Duration::from_secs(10), &shutdown, || async {
            let n = ticks.fetch_add(1, Ordering::SeqCst) + 1;
            if n == 3 {
                shutdown.cancel();
            }
            // Due in 50 ms, then "due" in a minute: the interval bounds it.
            let due = if n == 1 { 50 } else { 60_000 };
            Ok::<_, Infallible>(Next::Soon(Duration::from_millis(due)))
        })
        .await
        .unwrap();
        assert_eq!(ticks.load(Ordering::SeqCst), 3);
        assert_eq!(started.elapsed(), Duration::from_millis(10_050));
    }

    #[tokio::test(start_paused = true)]
    async fn a_wake_ends_the_wait_and_wakes_during_a_tick_make_one_more_tick() {
        let (shutdown, wake) = (CancellationToken::new(), Notify::new());
        let ticks = AtomicU32::new(0);
        let started = tokio::time::Instant::now();
        every_or_woken(Duration::from_secs(3600), &wake, &shutdown, || async {
            let n = ticks.fetch_add(1, Ordering::SeqCst) + 1;
            match n {
                // Woken three times while it runs: one tick follows at once.
                1 => (0..3).for_each(|_| wake.notify_one()),
                // Then woken by someone else after a while.
                2 => {
                    tokio::time::sleep(Duration::from_secs(5)).await;
                    wake.notify_one();
                }
                _ => shutdown.cancel(),
            }
            Ok::<_, Infallible>(Next::Wait)
        })
        .await
        .unwrap();
        assert_eq!(ticks.load(Ordering::SeqCst), 3);
        // No wait of the hour-long interval; only the second tick's own 5 s.
        assert_eq!(started.elapsed(), Duration::from_secs(5));
    }

    #[tokio::test(start_paused = true)]
    async fn an_error_ends_the_loop_and_shutdown_ends_the_wait() {
        let shutdown = CancellationToken::new();
        let result = every(Duration::from_secs(1), &shutdown, || async {
            Err::<Next, _>("broken")
        })
        .await;
        assert_eq!(result, Err("broken"));
        let waiting = tokio::spawn({
            let shutdown = shutdown.clone();
            async move {
                every(Duration::from_secs(3600), &shutdown, || async {
                    Ok::<_, Infallible>(Next::Wait)
                })
                .await
            }
        });
        tokio::time::sleep(Duration::from_secs(1)).await;
        shutdown.cancel();
        assert!(waiting.await.unwrap().is_ok());
    }
}
