//! What a transition does to other orders (see [`crate::machine::child`]),
//! in its transaction: a child a step started is stored and taken in, a
//! child its parent undoes is told, and the parent of an order that ended
//! decides its child's end. What each of those decides to publish joins
//! the deciding order's progress (`others`).
//!
//! Locks are taken parent first when a parent starts or undoes its child,
//! child first when a child's end reaches its parent: the two can meet (a
//! parent cancelled as its child ends), and Postgres then aborts one
//! transaction as a deadlock, which the schedulers and the supervisors
//! retry as any transient failure, and an operator's action runs again
//! (`Writes::transition_one`).

use std::future::Future;
use std::pin::Pin;

use sqlx::PgConnection;

use super::apply::{transition, Decided, Slots};
use super::intake::{insert_pending, Pending};
use crate::machine::child::{end_told, undo_answer, ChildCommand, ToParent, MAX_DEPTH};
use crate::machine::{Event, Snapshot};
use crate::model::NewStep;
use crate::{Store, StoreError};

/// The orders `decided` reach beyond themselves, decided in the same
/// transaction. Boxed: it runs the write kernel again, which may cascade
/// further (a chain of children is at most [`MAX_DEPTH`] deep).
///
/// # Errors
/// When the database fails, or a guard did not hold.
pub(crate) fn cascade<'a>(
    conn: &'a mut PgConnection,
    store: &'a Store,
    actor: &'a str,
    decided: &'a mut [Decided],
) -> Pin<Box<dyn Future<Output = Result<(), StoreError>> + Send + 'a>> {
    Box::pin(async move {
        for d in decided.iter_mut() {
            let Some(command) = d.decision.child.clone() else {
                continue;
            };
            let moved = match &command {
                ChildCommand::Start {
                    child,
                    step,
                    workflow,
                    version,
                    body,
                } => {
                    let start = ChildStart {
                        parent: &d.snapshot,
                        step,
                        child: child.as_str(),
                        workflow,
                        version: *version,
                        body,
                    };
                    start_child(&mut *conn, store, actor, &start).await?
                }
                ChildCommand::Undo {
                    child,
                    step,
                    reason,
                } => {
                    let parent = (d.snapshot.order_id.as_str(), step.as_str());
                    undo_child(&mut *conn, store, actor, parent, child.as_str(), reason).await?
                }
            };
            for m in moved {
                d.decision.progress.others.push(m.decision.progress);
            }
        }
        tell_parents(conn, store, actor, decided).await
    })
}

/// The parents of the orders of `decided` that ended (processed or
/// compensated) decide their child's end ([`end_told`]: with its steps'
/// results as the decision left them, the link and the steps read with the
/// snapshot).
async fn tell_parents(
    conn: &mut PgConnection,
    store: &Store,
    actor: &str,
    decided: &mut [Decided],
) -> Result<(), StoreError> {
    for d in decided.iter_mut() {
        let Some((parent, told)) = end_told(&d.snapshot, &d.decision) else {
            continue;
        };
        let (parent, step) = (parent.order_id.clone(), parent.step.clone());
        let child = d.snapshot.order_id.as_str();
        let told = tell(&mut *conn, store, actor, (&parent, &step), child, &told).await?;
        for m in told {
            d.decision.progress.others.push(m.decision.progress);
        }
    }
    Ok(())
}

/// Child `child` of step `parent.1` of order `parent.0` undoes itself for
/// its parent; the parent hears at once what [`undo_answer`] says it must.
async fn undo_child(
    conn: &mut PgConnection,
    store: &Store,
    actor: &str,
    parent: (&str, &str),
    child: &str,
    reason: &str,
) -> Result<Vec<Decided>, StoreError> {
    let event = Event::UndoneForParent { reason };
    let undone = transition(&mut *conn, store, &[child], actor, Slots::Check, |_| event).await?;
    let answer = undo_answer(
        child,
        parent.1,
        undone.first().map(|u| (&u.snapshot, &u.decision)),
    );
    match answer {
        Some(answer) => {
            let told = tell(&mut *conn, store, actor, parent, child, &answer).await?;
            Ok(undone.into_iter().chain(told).collect())
        }
        None => Ok(undone),
    }
}

/// Order `parent.0` hears `told` of `child`, the child of its step
/// `parent.1`.
async fn tell(
    conn: &mut PgConnection,
    store: &Store,
    actor: &str,
    (parent, step): (&str, &str),
    child: &str,
    told: &ToParent,
) -> Result<Vec<Decided>, StoreError> {
    let event = told.event(step, child);
    transition(conn, store, &[parent], actor, Slots::Check, |_| event).await
}

/// A child a parent's step starts (see [`ChildCommand::Start`]).
struct ChildStart<'a> {
    parent: &'a Snapshot,
    step: &'a str,
    child: &'a str,
    workflow: &'a str,
    version: i32,
    body: &'a serde_json::Value,
}

/// Stores the child order `start` names, from its workflow's registered
/// plan, with its link to its parent, and takes it in: its first step
/// starts with the parent's step, in the same transaction. The parent's
/// step is refused instead (see [`Event::ChildRefused`]) when the plan was
/// never registered, the child's attributes do not match its workflow's
/// schema, the child would be deeper than [`MAX_DEPTH`] or its tree hold
/// more than
/// [`MAX_TREE_ORDERS`](crate::machine::child::MAX_TREE_ORDERS) orders, or an order with
/// the child's id exists that the step did not start. A start taken in
/// already (its child linked to this step) changes nothing.
///
/// # Errors
/// When the database fails.
async fn start_child(
    conn: &mut PgConnection,
    store: &Store,
    actor: &str,
    start: &ChildStart<'_>,
) -> Result<Vec<Decided>, StoreError> {
    let parent = start.parent;
    let at = (parent.order_id.as_str(), start.step);
    // The same start, taken in already (a redelivery, a decision taken
    // again): nothing to check or store. Checked first, so that no limit
    // reached since refuses a child that runs.
    let linked: Option<(String, String)> = sqlx::query_as(
        "SELECT parent_order_id, step FROM order_children WHERE child_order_id = $1",
    )
    .bind(start.child)
    .fetch_optional(&mut *conn)
    .await?;
    let taken_in = linked
        .as_ref()
        .is_some_and(|(p, s)| (p.as_str(), s.as_str()) == at);
    if taken_in {
        return Ok(Vec::new());
    }
    let plan: Option<(sqlx::types::Json<Vec<NewStep>>, Option<serde_json::Value>)> =
        sqlx::query_as(
            "SELECT steps, attributes_schema FROM workflow_plans WHERE name = $1 AND version = $2",
        )
        .bind(start.workflow)
        .bind(start.version)
        .fetch_optional(&mut *conn)
        .await?;
    let Some((sqlx::types::Json(steps), schema)) = plan else {
        let refused = ToParent::not_registered(start.child, start.workflow, start.version);
        return tell(conn, store, actor, at, start.child, &refused).await;
    };
    let workflow = (start.workflow, start.version);
    if let Some(refused) = schema
        .and_then(|schema| ToParent::attributes_refused(start.child, workflow, &schema, start.body))
    {
        return tell(conn, store, actor, at, start.child, &refused).await;
    }
    // How deep the parent is (its chain of parents, as stored), the root of
    // its tree, and how many orders the tree holds: every order its root
    // started, at any depth and in every generation (an operator's
    // put-back starts new children). Read without a lock: starts committed
    // at the same instant in other branches of one tree may pass the bound
    // together.
    let (depth, root, size): (i32, String, i64) = sqlx::query_as(
        "WITH RECURSIVE up (order_id, depth) AS (
             SELECT $1::text, 0
             UNION ALL
             SELECT c.parent_order_id, up.depth + 1
               FROM order_children c JOIN up ON c.child_order_id = up.order_id
              WHERE up.depth <= $2),
         top AS (SELECT order_id, depth FROM up ORDER BY depth DESC LIMIT 1),
         down (order_id, depth) AS (
             SELECT order_id, 0 FROM top
             UNION ALL
             SELECT c.child_order_id, down.depth + 1
               FROM order_children c JOIN down ON c.parent_order_id = down.order_id
              WHERE down.depth <= $2)
         SELECT top.depth, top.order_id, (SELECT count(*) FROM down) FROM top",
    )
    .bind(parent.order_id.as_str())
    .bind(i32::try_from(MAX_DEPTH).unwrap_or(i32::MAX))
    .fetch_one(&mut *conn)
    .await?;
    if let Some(refused) =
        ToParent::too_deep(start.child, usize::try_from(depth).unwrap_or(usize::MAX))
    {
        return tell(conn, store, actor, at, start.child, &refused).await;
    }
    if let Some(refused) = ToParent::tree_full(
        start.child,
        &root,
        usize::try_from(size).unwrap_or(usize::MAX),
    ) {
        return tell(conn, store, actor, at, start.child, &refused).await;
    }
    let inserted = insert_pending(
        &mut *conn,
        &Pending {
            order_id: start.child,
            body: start.body,
            submitted_by: parent.submitted_by.as_deref(),
            workflow: start.workflow,
            version: start.version,
            reply_to: None,
            trace_id: parent.trace_id.as_deref(),
            priority: parent.priority,
            correlation_id: None,
            start_at: None,
        },
        &steps,
    )
    .await?;
    if !inserted {
        // An order with the child's id that this step did not start.
        let refused = ToParent::squatted(start.child);
        return tell(conn, store, actor, at, start.child, &refused).await;
    }
    sqlx::query(
        "INSERT INTO order_children (child_order_id, parent_order_id, step) VALUES ($1, $2, $3)",
    )
    .bind(start.child)
    .bind(parent.order_id.as_str())
    .bind(start.step)
    .execute(&mut *conn)
    .await?;
    transition(conn, store, &[start.child], actor, Slots::Check, |_| {
        Event::Submitted
    })
    .await
}
