//! Finding orders among millions: filters, keyset pages, and the sets bulk
//! actions work on.
//!
//! Pages are ordered newest first on `(created_at, order_id)` and continue
//! after a [`Cursor`] (the last row of the previous page), never with an
//! offset: every page costs the same however deep it is, and rows added
//! meanwhile do not shift the next page. The index `order_process_created`
//! (migration 0008) serves the order; the customer and id-prefix filters
//! have indexes of their own on `orders`. The other filters (state, failure
//! count, current step, priority) are applied while walking that order: they
//! are cheap when the rows they select are common, and a page of a rare
//! filter reads further down the index.

use std::fmt;

use chrono::{DateTime, NaiveDateTime, Utc};
use serde::Serialize;
use sqlx::{Postgres, QueryBuilder};

use super::Reads;
use crate::model::ProcessState;
use crate::StoreError;

/// Longest page a caller may ask for.
pub const MAX_PAGE: i64 = 500;

/// Which orders to show or act on. Every field narrows the set; an empty
/// filter selects every order.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct OrderFilter {
    /// In one of these states (any state when empty).
    pub states: Vec<ProcessState>,
    /// Of this customer (`customer_id` of the order, exactly).
    pub customer: Option<String>,
    /// Submitted at or after this instant.
    pub from: Option<DateTime<Utc>>,
    /// Submitted before this instant.
    pub to: Option<DateTime<Utc>>,
    /// With at least this many failures.
    pub min_failures: Option<i32>,
    /// Whose current step (in flight, being undone, or the one refused) is this one.
    pub step: Option<String>,
    /// Of this priority (0 to 9).
    pub priority: Option<i16>,
    /// Whose id starts with this (an exact id is a prefix of itself).
    pub id: Option<String>,
    /// Started by a child step of this order (its id, exactly): the
    /// children of one parent, whatever their ids.
    pub parent: Option<String>,
}

/// Where a page ends: the `(created_at, order_id)` of its last row. Written
/// as `<microseconds since the epoch>:<order id>` in URLs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cursor {
    /// Submission time of the last row shown.
    pub created_at: DateTime<Utc>,
    /// Its order id.
    pub order_id: String,
}

impl fmt::Display for Cursor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{}",
            self.created_at.timestamp_micros(),
            self.order_id
        )
    }
}

/// Why a filter or a cursor was refused: the parameter and what is expected,
/// for a 400 answer or a CLI error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("bad filter {parameter}={value:?}: {expected}")]
pub struct FilterError {
    /// The query parameter.
    pub parameter: String,
    /// What it held.
    pub value: String,
    /// What it should hold.
    pub expected: String,
}

fn refuse(parameter: &str, value: &str, expected: &str) -> FilterError {
    FilterError {
        parameter: parameter.to_owned(),
        value: value.chars().take(100).collect(),
        expected: expected.to_owned(),
    }
}

/// An order id or customer id as the intake accepts them: 1 to 64 of `A-Z a-z 0-9 - _ . :`.
fn is_id(text: &str) -> bool {
    (1..=64).contains(&text.len())
        && text
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':'))
}

/// An order id as the store keeps it: a client's id ([`is_id`]), and
/// `@tenant` after it for a tenant's order
/// ([`sas_messages::ids::OrderId::qualified`]).
fn is_stored_id(text: &str) -> bool {
    match text.rsplit_once(sas_messages::ids::TENANT_SEPARATOR) {
        Some((id, tenant)) => is_id(id) && sas_messages::ids::is_tenant_name(tenant),
        None => is_id(text),
    }
}

/// An instant: RFC 3339, or `YYYY-MM-DDTHH:MM[:SS]` (an HTML
/// `datetime-local` field) read as UTC.
fn parse_instant(parameter: &str, value: &str) -> Result<DateTime<Utc>, FilterError> {
    if let Ok(instant) = DateTime::parse_from_rfc3339(value) {
        return Ok(instant.with_timezone(&Utc));
    }
    for format in ["%Y-%m-%dT%H:%M:%S", "%Y-%m-%dT%H:%M"] {
        if let Ok(naive) = NaiveDateTime::parse_from_str(value, format) {
            return Ok(naive.and_utc());
        }
    }
    Err(refuse(
        parameter,
        value,
        "an instant such as 2026-11-23T08:00:00Z (RFC 3339), or 2026-11-23T08:00 read as UTC",
    ))
}

impl std::str::FromStr for Cursor {
    type Err = FilterError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let expected =
            "a cursor from the previous page's \"next\" link (<microseconds>:<order id>)";
        let (micros, order_id) = text
            .split_once(':')
            .ok_or_else(|| refuse("after", text, expected))?;
        let created_at = micros
            .parse::<i64>()
            .ok()
            .and_then(DateTime::from_timestamp_micros)
            .ok_or_else(|| refuse("after", text, expected))?;
        if !is_id(order_id) {
            return Err(refuse("after", text, expected));
        }
        Ok(Self {
            created_at,
            order_id: order_id.to_owned(),
        })
    }
}

/// The parameters a listing accepts besides the filter's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Page {
    /// Continue after this row.
    pub after: Option<Cursor>,
    /// Rows per page, 1 to [`MAX_PAGE`].
    pub limit: i64,
}

impl OrderFilter {
    /// The filter's own parameter names.
    pub const PARAMETERS: [&'static str; 9] = [
        "state",
        "customer",
        "from",
        "to",
        "min_failures",
        "step",
        "priority",
        "id",
        "parent",
    ];

    /// Reads a filter from query parameters (`state` may repeat or hold a
    /// comma-separated list). Empty values are ignored (an HTML form sends
    /// its empty fields); names in `other` are left to the caller; any other
    /// name is refused, so a misspelt filter never silently selects every
    /// order, which matters before a bulk action.
    ///
    /// # Errors
    /// A [`FilterError`] naming the parameter and what it should hold.
    pub fn from_pairs<'a>(
        pairs: impl IntoIterator<Item = (&'a str, &'a str)>,
        other: &[&str],
    ) -> Result<Self, FilterError> {
        let mut filter = Self::default();
        for (name, value) in pairs {
            let value = value.trim();
            if value.is_empty() || other.contains(&name) {
                continue;
            }
            match name {
                "state" => {
                    for state in value.split(',').map(str::trim).filter(|s| !s.is_empty()) {
                        let state: ProcessState = state
                            .parse()
                            .map_err(|message: String| refuse("state", state, &message))?;
                        if !filter.states.contains(&state) {
                            filter.states.push(state);
                        }
                    }
                }
                "customer" => {
                    if !is_id(value) {
                        return Err(refuse(
                            name,
                            value,
                            "a customer id: 1 to 64 of A-Z a-z 0-9 - _ . :",
                        ));
                    }
                    filter.customer = Some(value.to_owned());
                }
                "from" => filter.from = Some(parse_instant(name, value)?),
                "to" => filter.to = Some(parse_instant(name, value)?),
                "min_failures" => {
                    filter.min_failures = Some(
                        value
                            .parse::<i32>()
                            .ok()
                            .filter(|n| (0..=1_000_000).contains(n))
                            .ok_or_else(|| refuse(name, value, "a whole number from 0"))?,
                    );
                }
                "step" => {
                    if !(1..=64).contains(&value.len())
                        || !value
                            .bytes()
                            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
                    {
                        return Err(refuse(name, value, "a step name such as charge_payment"));
                    }
                    filter.step = Some(value.to_owned());
                }
                "priority" => {
                    filter.priority = Some(
                        value
                            .parse::<i16>()
                            .ok()
                            .filter(|n| (0..=9).contains(n))
                            .ok_or_else(|| refuse(name, value, "a priority from 0 to 9"))?,
                    );
                }
                "id" => {
                    if !is_id(value) {
                        return Err(refuse(
                            name,
                            value,
                            "an order id or its beginning: 1 to 64 of A-Z a-z 0-9 - _ . :",
                        ));
                    }
                    filter.id = Some(value.to_owned());
                }
                "parent" => {
                    if !is_stored_id(value) {
                        return Err(refuse(
                            name,
                            value,
                            "a parent order's id as the console and sasctl show it: 1 to 64 of A-Z a-z 0-9 - _ . :, then @tenant for a tenant's order",
                        ));
                    }
                    filter.parent = Some(value.to_owned());
                }
                _ => {
                    let mut known: Vec<&str> = Self::PARAMETERS.to_vec();
                    known.extend_from_slice(other);
                    return Err(refuse(
                        name,
                        value,
                        &format!("no such parameter; known ones are {}", known.join(", ")),
                    ));
                }
            }
        }
        if let (Some(from), Some(to)) = (filter.from, filter.to) {
            if from >= to {
                return Err(refuse("to", &to.to_rfc3339(), "an instant after `from`"));
            }
        }
        Ok(filter)
    }

    /// The filter as query parameters (the inverse of [`OrderFilter::from_pairs`]).
    pub fn to_pairs(&self) -> Vec<(&'static str, String)> {
        let mut pairs = Vec::new();
        if !self.states.is_empty() {
            let states: Vec<&str> = self.states.iter().map(|s| s.as_str()).collect();
            pairs.push(("state", states.join(",")));
        }
        if let Some(customer) = &self.customer {
            pairs.push(("customer", customer.clone()));
        }
        if let Some(from) = self.from {
            pairs.push(("from", from.to_rfc3339()));
        }
        if let Some(to) = self.to {
            pairs.push(("to", to.to_rfc3339()));
        }
        if let Some(n) = self.min_failures {
            pairs.push(("min_failures", n.to_string()));
        }
        if let Some(step) = &self.step {
            pairs.push(("step", step.clone()));
        }
        if let Some(priority) = self.priority {
            pairs.push(("priority", priority.to_string()));
        }
        if let Some(id) = &self.id {
            pairs.push(("id", id.clone()));
        }
        if let Some(parent) = &self.parent {
            pairs.push(("parent", parent.clone()));
        }
        pairs
    }

    /// Appends ` AND ...` conditions on `p` (order_process) and `o` (orders).
    fn push_conditions(&self, query: &mut QueryBuilder<Postgres>) {
        if !self.states.is_empty() {
            query.push(" AND p.state = ANY(");
            query.push_bind(self.states.clone());
            query.push(")");
        }
        if let Some(customer) = &self.customer {
            query.push(" AND o.body ->> 'customer_id' = ");
            query.push_bind(customer.clone());
        }
        if let Some(from) = self.from {
            query.push(" AND p.created_at >= ");
            query.push_bind(from);
        }
        if let Some(to) = self.to {
            query.push(" AND p.created_at < ");
            query.push_bind(to);
        }
        if let Some(n) = self.min_failures {
            query.push(" AND p.failure_count >= ");
            query.push_bind(n);
        }
        if let Some(step) = &self.step {
            query.push(
                " AND EXISTS (SELECT 1 FROM steps s WHERE s.order_id = p.order_id
                   AND s.state IN ('running', 'compensating', 'failed') AND s.name = ",
            );
            query.push_bind(step.clone());
            query.push(")");
        }
        if let Some(priority) = self.priority {
            query.push(" AND p.priority = ");
            query.push_bind(priority);
        }
        if let Some(id) = &self.id {
            // The id's characters hold no LIKE wildcard but `_`, escaped here.
            query.push(" AND o.order_id LIKE ");
            query.push_bind(format!("{}%", id.replace('_', "\\_")));
        }
        if let Some(parent) = &self.parent {
            // Served by the links' index on the parent.
            query.push(
                " AND p.order_id IN (SELECT c.child_order_id FROM order_children c
                   WHERE c.parent_order_id = ",
            );
            query.push_bind(parent.clone());
            query.push(")");
        }
    }
}

impl Page {
    /// Reads `after` and `limit` from query parameters (the rest is the filter's).
    ///
    /// # Errors
    /// A [`FilterError`] naming the parameter.
    pub fn from_pairs<'a>(
        pairs: impl IntoIterator<Item = (&'a str, &'a str)>,
        default_limit: i64,
    ) -> Result<Self, FilterError> {
        let mut page = Self {
            after: None,
            limit: default_limit,
        };
        for (name, value) in pairs {
            let value = value.trim();
            if value.is_empty() {
                continue;
            }
            match name {
                "after" => page.after = Some(value.parse()?),
                "limit" => {
                    page.limit = value
                        .parse::<i64>()
                        .ok()
                        .filter(|n| (1..=MAX_PAGE).contains(n))
                        .ok_or_else(|| {
                            refuse("limit", value, &format!("a number from 1 to {MAX_PAGE}"))
                        })?;
                }
                _ => {}
            }
        }
        Ok(page)
    }
}

/// One row of the orders list.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct OrderRow {
    /// The client's order id.
    pub order_id: String,
    /// Its customer.
    pub customer_id: Option<String>,
    /// ProcessState.
    pub state: ProcessState,
    /// Failures so far.
    pub failure_count: i32,
    /// Priority, 0 to 9.
    pub priority: i16,
    /// The step in flight, being undone, or refused, if any.
    pub current_step: Option<String>,
    /// Why it failed, if it did.
    pub last_error: Option<String>,
    /// Submission time.
    pub created_at: DateTime<Utc>,
    /// Last change.
    pub updated_at: DateTime<Utc>,
}

impl OrderRow {
    /// The cursor that continues after this row.
    pub fn cursor(&self) -> Cursor {
        Cursor {
            created_at: self.created_at,
            order_id: self.order_id.clone(),
        }
    }
}

/// One page of orders and where the next one starts.
#[derive(Debug, Clone, Serialize)]
pub struct OrderPage {
    /// The rows, newest first.
    pub orders: Vec<OrderRow>,
    /// The cursor of the next page, when there is one.
    pub next: Option<String>,
}

impl Reads<'_> {
    /// One page of the orders `filter` selects, newest first.
    ///
    /// # Errors
    /// When the database fails.
    pub async fn search_orders(
        self,
        filter: &OrderFilter,
        page: &Page,
    ) -> Result<OrderPage, StoreError> {
        let mut query = QueryBuilder::new(
            "SELECT p.order_id, o.body ->> 'customer_id' AS customer_id, p.state,
                    p.failure_count, p.priority, p.last_error, p.created_at, p.updated_at,
                    (SELECT s.name FROM steps s WHERE s.order_id = p.order_id
                        AND s.state IN ('running', 'compensating', 'failed')
                      ORDER BY s.state = 'failed', s.position DESC LIMIT 1) AS current_step
               FROM order_process p JOIN orders o ON o.order_id = p.order_id
              WHERE true",
        );
        filter.push_conditions(&mut query);
        if let Some(after) = &page.after {
            query.push(" AND (p.created_at, p.order_id) < (");
            query.push_bind(after.created_at);
            query.push(", ");
            query.push_bind(after.order_id.clone());
            query.push(")");
        }
        query.push(" ORDER BY p.created_at DESC, p.order_id DESC LIMIT ");
        query.push_bind(page.limit + 1);
        let mut orders: Vec<OrderRow> = query.build_query_as().fetch_all(self.pool()).await?;
        let next = if orders.len() as i64 > page.limit {
            orders.truncate(page.limit as usize);
            orders.last().map(|row| row.cursor().to_string())
        } else {
            None
        };
        Ok(OrderPage { orders, next })
    }

    /// How many orders `filter` selects among those in `eligible` states
    /// (the preview of a bulk action).
    ///
    /// # Errors
    /// When the database fails.
    pub async fn count_orders(
        self,
        filter: &OrderFilter,
        eligible: &[ProcessState],
    ) -> Result<i64, StoreError> {
        let mut query = QueryBuilder::new(
            "SELECT count(*) FROM order_process p JOIN orders o ON o.order_id = p.order_id
              WHERE p.state = ANY(",
        );
        query.push_bind(eligible.to_vec());
        query.push(")");
        filter.push_conditions(&mut query);
        Ok(query.build_query_scalar().fetch_one(self.pool()).await?)
    }

    /// The ids of at most `limit` orders `filter` selects among those in
    /// `eligible` states, oldest first (what a bulk action goes through).
    ///
    /// # Errors
    /// When the database fails.
    pub async fn select_order_ids(
        self,
        filter: &OrderFilter,
        eligible: &[ProcessState],
        limit: i64,
    ) -> Result<Vec<String>, StoreError> {
        let mut query = QueryBuilder::new(
            "SELECT p.order_id FROM order_process p JOIN orders o ON o.order_id = p.order_id
              WHERE p.state = ANY(",
        );
        query.push_bind(eligible.to_vec());
        query.push(")");
        filter.push_conditions(&mut query);
        query.push(" ORDER BY p.created_at, p.order_id LIMIT ");
        query.push_bind(limit);
        Ok(query.build_query_scalar().fetch_all(self.pool()).await?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(query: &[(&str, &str)]) -> Result<OrderFilter, FilterError> {
        OrderFilter::from_pairs(query.iter().copied(), &["after", "limit"])
    }

    #[test]
    fn a_filter_reads_back_from_its_own_parameters() {
        let filter = parse(&[
            ("state", "error,compensated"),
            ("state", "error"),
            ("customer", "cust-7"),
            ("from", "2026-11-23T08:00"),
            ("to", "2026-11-23T10:00:00+01:00"),
            ("min_failures", "2"),
            ("step", "charge_payment"),
            ("priority", "9"),
            ("id", "ord-1"),
            ("parent", "ord-1@shop"),
        ])
        .unwrap();
        assert_eq!(filter.parent.as_deref(), Some("ord-1@shop"));
        assert_eq!(
            filter.states,
            vec![ProcessState::Error, ProcessState::Compensated]
        );
        assert_eq!(
            filter.to.unwrap() - filter.from.unwrap(),
            chrono::Duration::hours(1)
        );
        let pairs = filter.to_pairs();
        let again = parse(
            &pairs
                .iter()
                .map(|(k, v)| (*k, v.as_str()))
                .collect::<Vec<_>>(),
        )
        .unwrap();
        assert_eq!(again, filter);
    }

    #[test]
    fn bad_values_name_the_parameter_and_what_it_should_hold() {
        for (query, parameter) in [
            (vec![("state", "broken")], "state"),
            (vec![("priority", "10")], "priority"),
            (vec![("min_failures", "-1")], "min_failures"),
            (vec![("from", "yesterday")], "from"),
            (vec![("id", "ord 1; drop")], "id"),
            (vec![("parent", "ord-1@Shop!")], "parent"),
            (vec![("parent", "@shop")], "parent"),
            (
                vec![("customer", "x".repeat(65).leak() as &str)],
                "customer",
            ),
            (vec![("stat", "error")], "stat"),
        ] {
            let error = parse(&query).unwrap_err();
            assert_eq!(error.parameter, parameter, "{error}");
            assert!(!error.expected.is_empty());
        }
        let error = parse(&[("from", "2026-11-23T09:00"), ("to", "2026-11-23T08:00")]).unwrap_err();
        assert_eq!(error.parameter, "to");
    }

    #[test]
    fn empty_values_and_the_caller_s_parameters_are_skipped() {
        let filter = parse(&[
            ("state", ""),
            ("customer", " "),
            ("after", "x"),
            ("limit", "5"),
        ])
        .unwrap();
        assert_eq!(filter, OrderFilter::default());
    }

    #[test]
    fn a_cursor_reads_back_and_a_forged_one_is_refused() {
        let cursor = Cursor {
            created_at: DateTime::from_timestamp_micros(1_763_884_800_123_456).unwrap(),
            order_id: "ord:1".into(),
        };
        assert_eq!(cursor.to_string().parse::<Cursor>().unwrap(), cursor);
        for bad in ["", "abc:ord", "123", "123:ord 1", "123:"] {
            assert_eq!(
                bad.parse::<Cursor>().unwrap_err().parameter,
                "after",
                "{bad}"
            );
        }
    }
}
