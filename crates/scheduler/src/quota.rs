//! Tenant quotas at intake: an order of a tenant with a quota
//! (`tenants.<t>.quota`) takes a turn of it in the store before it is
//! stored; over it, the order is refused or held back as configured.

use chrono::{DateTime, Utc};
use sas_broker::consume::Consumed;
use sas_runtime::tenancy::OverQuota;
use sas_store::quota::QuotaTurn;

use crate::Scheduler;

/// What the quota says of one order.
pub(crate) enum QuotaVerdict {
    /// Store it, starting now (`None`) or not before the time given.
    Store(Option<DateTime<Utc>>),
    /// Refuse it, for this reason (it says when it would fit).
    Refuse(String),
    /// The scheduler is stopping, or the store failed for good (logged):
    /// hand the message back.
    GiveBack(Consumed),
}

impl Scheduler {
    /// Takes a turn of `tenant`'s quota for its order `order_id` (the
    /// stored id), if the tenant has one, retrying while the store's
    /// failures are transient. An order already stored takes none: intake
    /// answers it as a duplicate (or a conflict).
    pub(crate) async fn quota_turn(&self, tenant: &str, order_id: &str) -> QuotaVerdict {
        let Some(quota) = self.tenancy.quota(tenant) else {
            return QuotaVerdict::Store(None);
        };
        let taken = sas_runtime::retry_transient(
            &self.shutdown,
            "taking a turn of a tenant's quota",
            |e: &sas_store::StoreError| e.is_transient(),
            || self.store.admission().take_quota(tenant, quota, order_id),
        )
        .await;
        match taken {
            None => QuotaVerdict::GiveBack(Consumed::Requeue),
            Some(Err(error)) => {
                tracing::error!(tenant, error = %error, "cannot take a turn of the tenant's quota");
                QuotaVerdict::GiveBack(Consumed::Requeue)
            }
            Some(Ok(QuotaTurn::Now | QuotaTurn::Stored)) => QuotaVerdict::Store(None),
            Some(Ok(QuotaTurn::At(at))) => {
                metrics::counter!("sas_orders_over_quota_total", "outcome" => "queued")
                    .increment(1);
                QuotaVerdict::Store(Some(at))
            }
            Some(Ok(QuotaTurn::Over(fits_in))) => {
                metrics::counter!("sas_orders_over_quota_total", "outcome" => "refused")
                    .increment(1);
                let held = match quota.over {
                    OverQuota::Refuse => String::new(),
                    OverQuota::Queue => format!(
                        ", and it would wait more than {} s (max_wait_secs)",
                        quota.max_wait.as_secs()
                    ),
                };
                QuotaVerdict::Refuse(format!(
                    "tenant {tenant} is over its quota of {} orders a second, {} at once (tenants.{tenant}.quota){held}: send it again in {:.1} s",
                    quota.per_second,
                    quota.burst,
                    fits_in.as_secs_f64().max(0.1)
                ))
            }
        }
    }
}
