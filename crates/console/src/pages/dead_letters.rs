//! Dead letters: body and reason; replay to the source queue, or discard.

use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::response::{Html, Response};
use axum::Extension;
use maud::html;
use serde::Deserialize;

use crate::auth::Principal;
use crate::error::PageFailure;
use crate::Console;

/// Query of the dead letters page.
#[derive(Debug, Deserialize)]
pub struct DeadLettersQuery {
    /// What the last action did.
    pub notice: Option<String>,
}

/// `GET /dead-letters`: the newest 200.
pub async fn page(
    State(console): State<Arc<Console>>,
    Extension(who): Extension<Principal>,
    Query(query): Query<DeadLettersQuery>,
) -> Result<Html<String>, PageFailure> {
    let letters = console.store.reads().dead_letters(200).await?;
    let act = super::may_act(&who);
    Ok(super::layout(
        "Dead letters",
        "/dead-letters",
        &who,
        html! {
            h1 { "Dead letters" }
            (super::notice(query.notice.as_deref()))
            p.muted { "The newest 200 recorded. The body shown is the record's text; RabbitMQ's queue "
                code { (console.names.dead_letters()) } " keeps the exact bytes." }
            @if letters.is_empty() { p.muted #no-dead-letters { "None." } }
            table #dead-letters {
                tr { th { "#" } th { "at" } th { "from" } th { "order" } th { "reason" } th { "body" } th { "" } }
                @for letter in &letters {
                    tr data-dead-letter=(letter.id) {
                        td { (letter.id) }
                        td { (super::when(letter.at)) }
                        td { (letter.source_queue.as_deref().unwrap_or("-")) }
                        td { @if let Some(order) = &letter.order_id { a href={ "/orders/" (order) } { (order) } } }
                        td { (letter.reason) }
                        td { pre { (letter.body.chars().take(4000).collect::<String>()) } }
                        td {
                            @if let Some(done) = &letter.disposition {
                                span.disposition { (done) } " " (super::when_opt(letter.disposed_at))
                                " by " (letter.disposed_by.as_deref().unwrap_or("?"))
                            } @else if act {
                                form.inline method="post" action={ "/dead-letters/" (letter.id) "/replay" } {
                                    (super::csrf_field(&console, &who))
                                    button type="submit" .replay { "Replay" }
                                }
                                " "
                                form.inline method="post" action={ "/dead-letters/" (letter.id) "/discard" } {
                                    (super::csrf_field(&console, &who))
                                    button type="submit" .discard { "Discard" }
                                }
                            }
                        }
                    }
                }
            }
        },
    ))
}

/// `POST /dead-letters/{id}/replay`.
pub async fn replay(
    State(console): State<Arc<Console>>,
    Extension(who): Extension<Principal>,
    Path(id): Path<i64>,
) -> Result<Response, PageFailure> {
    let done = console.replay_dead_letter(id, &who).await?;
    Ok(super::redirect_with_notice("/dead-letters", &done.message))
}

/// `POST /dead-letters/{id}/discard`.
pub async fn discard(
    State(console): State<Arc<Console>>,
    Extension(who): Extension<Principal>,
    Path(id): Path<i64>,
) -> Result<Response, PageFailure> {
    let done = console.discard_dead_letter(id, &who).await?;
    Ok(super::redirect_with_notice("/dead-letters", &done.message))
}
