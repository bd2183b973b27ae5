//! Tenant quotas: how many orders a tenant may start, one row per capped
//! tenant shared by every scheduler (migration 0028, a generic cell rate
//! algorithm). Intake takes one turn per order of a tenant with a quota.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sas_runtime::tenancy::Quota;

use crate::{Admission, StoreError};

/// What a tenant's quota says of one more order.
#[derive(Debug, Clone, PartialEq)]
pub enum QuotaTurn {
    /// Within the quota: start it now.
    Now,
    /// Over the rate, within the wait a queued quota allows: start it at
    /// this time (database clock), and not before.
    At(DateTime<Utc>),
    /// Over the quota: refused, and nothing taken. The same order would
    /// fit after this long.
    Over(Duration),
    /// An order of this id is stored already (a redelivery, a client
    /// sending it again): nothing taken; intake answers it as a duplicate
    /// or a conflict, as ever.
    Stored,
}

impl Admission<'_> {
    /// Takes a turn of `tenant`'s `quota` for its order `order_id` (the
    /// stored id), atomically across schedulers (the tenant's row is
    /// locked for the statement): the order's time to start, or how long
    /// until it would fit. An order already stored takes no turn.
    ///
    /// # Errors
    /// When the database fails; nothing is taken then.
    pub async fn take_quota(
        self,
        tenant: &str,
        quota: &Quota,
        order_id: &str,
    ) -> Result<QuotaTurn, StoreError> {
        let emission = quota.emission().as_secs_f64();
        let tolerance = quota.tolerance().as_secs_f64();
        let horizon = quota.max_wait.as_secs_f64();
        // The first order of a tenant makes its row; the rest move it when
        // they fit, and leave it alone when they do not.
        let taken: Option<(DateTime<Utc>, DateTime<Utc>)> = sqlx::query_as(
            "INSERT INTO tenant_quota AS q (tenant, tat)
             SELECT $1, now() + make_interval(secs => $2)
              WHERE NOT EXISTS (SELECT FROM orders WHERE order_id = $5)
             ON CONFLICT (tenant) DO UPDATE
                SET tat = GREATEST(q.tat, now()) + make_interval(secs => $2)
              WHERE GREATEST(q.tat, now()) - make_interval(secs => $3)
                    <= now() + make_interval(secs => $4)
             RETURNING tat - make_interval(secs => $2 + $3), now()",
        )
        .bind(tenant)
        .bind(emission)
        .bind(tolerance)
        .bind(horizon)
        .bind(order_id)
        .fetch_optional(self.pool())
        .await?;
        if let Some((start, now)) = taken {
            return Ok(if start > now {
                QuotaTurn::At(start)
            } else {
                QuotaTurn::Now
            });
        }
        let (stored, fits_in): (bool, Option<f64>) = sqlx::query_as(
            "SELECT EXISTS (SELECT FROM orders WHERE order_id = $4),
                    (SELECT GREATEST(EXTRACT(EPOCH FROM GREATEST(tat, now()) - now())::float8 - $2 - $3, 0)
                       FROM tenant_quota WHERE tenant = $1)",
        )
        .bind(tenant)
        .bind(tolerance)
        .bind(horizon)
        .bind(order_id)
        .fetch_one(self.pool())
        .await?;
        if stored {
            return Ok(QuotaTurn::Stored);
        }
        Ok(QuotaTurn::Over(Duration::from_secs_f64(
            fits_in.unwrap_or(0.0),
        )))
    }

    /// How long until `tenant`'s quota would take one more order, read
    /// without taking a turn (`None`: it would take it now, or within the
    /// wait a queued quota allows). The gateway's answer at once (429 with
    /// `Retry-After`) for an order intake would refuse; intake still takes
    /// the turn, so a race between the two only ever refuses later.
    ///
    /// # Errors
    /// When the database fails.
    pub async fn quota_wait(
        self,
        tenant: &str,
        quota: &Quota,
    ) -> Result<Option<Duration>, StoreError> {
        let over: Option<f64> = sqlx::query_scalar(
            "SELECT EXTRACT(EPOCH FROM GREATEST(tat, now()) - now())::float8 - $2 - $3
               FROM tenant_quota WHERE tenant = $1",
        )
        .bind(tenant)
        .bind(quota.tolerance().as_secs_f64())
        .bind(quota.max_wait.as_secs_f64())
        .fetch_optional(self.pool())
        .await?;
        Ok(over
            .filter(|seconds| *seconds > 0.0)
            .map(Duration::from_secs_f64))
    }
}
