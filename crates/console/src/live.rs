//! Live updates: server-sent events that carry the new HTML of a page's
//! live part whenever it changes. Each stream renders its part every
//! `console.live_interval_ms` and sends it only when it differs from what
//! it sent last (the overview's numbers are shared between streams, see
//! [`crate::overview`]); the page's script swaps it in. SSE rather than
//! polling: one request per viewer instead of one per interval, and the
//! browser reconnects by itself. Streams end at shutdown.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, State};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::routing::get;
use axum::{Extension, Router};
use futures_util::Stream;

use crate::auth::Principal;
use crate::error::Failure;
use crate::Console;

/// The live streams' routes (behind the guard).
pub fn routes() -> Router<Arc<Console>> {
    Router::new()
        .route("/live/overview", get(overview))
        .route("/live/orders/{id}", get(order))
}

/// A stream of `render`'s output, sent when it changes.
fn changes<F, Fut>(
    console: Arc<Console>,
    render: F,
) -> impl Stream<Item = Result<Event, Infallible>>
where
    F: Fn(Arc<Console>) -> Fut + Send + 'static,
    Fut: Future<Output = Result<String, Failure>> + Send,
{
    let interval = Duration::from_millis(console.settings.console.live_interval_ms);
    futures_util::stream::unfold(
        (console, render, None::<String>, true),
        move |(console, render, last, first)| async move {
            let mut last = last;
            let mut first = first;
            loop {
                if !first {
                    tokio::select! {
                        () = tokio::time::sleep(interval) => {}
                        () = console.shutdown.cancelled() => return None,
                    }
                }
                first = false;
                match render(console.clone()).await {
                    Ok(html) if last.as_deref() != Some(html.as_str()) => {
                        last = Some(html.clone());
                        let event = Event::default().data(html);
                        return Some((Ok(event), (console, render, last, first)));
                    }
                    Ok(_) => {}
                    // Nothing will ever be there (no such order): end the stream.
                    Err(failure) if failure.status == axum::http::StatusCode::NOT_FOUND => {
                        return None
                    }
                    Err(failure) => {
                        tracing::debug!(error = %failure.message, "a live update could not be rendered");
                    }
                }
            }
        },
    )
}

async fn overview(
    State(console): State<Arc<Console>>,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    Sse::new(changes(console, |console| async move {
        let overview = console.overview().await?;
        Ok(crate::pages::overview::fragment(&overview).into_string())
    }))
    .keep_alive(KeepAlive::default())
}

async fn order(
    State(console): State<Arc<Console>>,
    Extension(who): Extension<Principal>,
    Path(order_id): Path<String>,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    Sse::new(changes(console, move |console| {
        let (order_id, who) = (order_id.clone(), who.clone());
        async move {
            let view = crate::pages::order::load(&console, &order_id).await?;
            Ok(crate::pages::order::fragment(&view, &console, &who).into_string())
        }
    }))
    .keep_alive(KeepAlive::default())
}
