//! The workflows the schedulers registered, as the gateway checks a
//! submission against them: an unknown workflow, or attributes against the
//! newest version's JSON Schema, is refused at once (400, naming the
//! reason as intake would), instead of 202 and a refusal only `GET` shows.
//!
//! Read from the store (`workflow_plans`, which every scheduler fills at
//! start), kept for [`FRESH_FOR`], and read again for a name not known
//! yet (a workflow added since), at most once per [`UNKNOWN_RETRY`]. A store that cannot be read refuses
//! nothing: intake still checks, and `GET` answers its refusal.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use sas_messages::SubmitOrder;
use sas_store::reads::workflows::WorkflowSchema;
use sas_store::Store;
use tokio::sync::Mutex;

/// How long the registered workflows are taken as they were read.
pub const FRESH_FOR: Duration = Duration::from_secs(10);

/// One workflow, ready to check attributes against.
struct Known {
    version: i32,
    schema: Option<jsonschema::Validator>,
}

/// The least time between two reads for a name not known: a client that
/// sends made-up names makes at most one read a second.
pub const UNKNOWN_RETRY: Duration = Duration::from_secs(1);

/// The registered workflows as last read, shared by the requests.
type Catalog = std::sync::Arc<BTreeMap<String, Known>>;

/// The registered workflows, read lazily.
#[derive(Default)]
pub struct Workflows {
    /// When they were last read (or last failed to be), and what was read;
    /// held only to copy or swap the `Arc`, never across a read or a check.
    cache: std::sync::Mutex<Option<(Instant, Catalog)>>,
    /// One read of the store at a time: the requests that find the cache
    /// stale meanwhile wait for it, then use what it read.
    reading: Mutex<()>,
}

impl Workflows {
    /// The workflows as read, if the cache holds them fresh for `name`.
    fn fresh(&self, name: &str) -> Option<Catalog> {
        let cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        let (read, known) = cache.as_ref()?;
        let stale = read.elapsed() > FRESH_FOR
            || (!known.contains_key(name) && read.elapsed() > UNKNOWN_RETRY);
        (!stale).then(|| known.clone())
    }

    /// The workflows, read again if stale for `name`. A store that cannot
    /// be read leaves what was read before (nothing, at first), read again
    /// as if just read (after [`UNKNOWN_RETRY`] for a name not in it), so
    /// an outage costs about one read a second, not one a request.
    async fn known(&self, store: &Store, name: &str) -> Catalog {
        if let Some(known) = self.fresh(name) {
            return known;
        }
        let _one = self.reading.lock().await;
        if let Some(known) = self.fresh(name) {
            return known;
        }
        let known = match store.reads().workflow_schemas().await {
            Ok(rows) => Catalog::new(compile(rows)),
            Err(error) => {
                tracing::warn!(%error, "cannot read the registered workflows; intake will check the orders meanwhile");
                let cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
                cache
                    .as_ref()
                    .map(|(_, known)| known.clone())
                    .unwrap_or_default()
            }
        };
        *self.cache.lock().unwrap_or_else(|e| e.into_inner()) =
            Some((Instant::now(), known.clone()));
        known
    }

    /// Why intake would refuse `order` for its workflow, if it would: a
    /// workflow no scheduler registered, or attributes that do not match
    /// its newest version's schema (the path of the first error). `None`
    /// also when the store cannot be read (intake checks anyway).
    pub async fn refusal(&self, store: &Store, order: &SubmitOrder) -> Option<String> {
        let name = order.workflow();
        let known = self.known(store, name).await;
        if known.is_empty() {
            // No scheduler has registered yet, or the store cannot be
            // read: intake decides.
            return None;
        }
        let Some(workflow) = known.get(name) else {
            let names: Vec<&str> = known.keys().map(String::as_str).collect();
            return Some(format!(
                "unknown workflow {name:?}: this deployment runs {}",
                names.join(", ")
            ));
        };
        let schema = workflow.schema.as_ref()?;
        let attributes = serde_json::Value::Object(order.attributes.clone().unwrap_or_default());
        sas_messages::attributes::refusal(schema, name, workflow.version, &attributes)
    }
}

/// The rows as checkers; a schema that does not compile checks nothing
/// (the scheduler that registered it refused to start with it).
fn compile(rows: Vec<WorkflowSchema>) -> BTreeMap<String, Known> {
    rows.into_iter()
        .map(|row| {
            let schema = row
                .attributes_schema
                .as_ref()
                .and_then(|schema| jsonschema::validator_for(schema).ok());
            (
                row.name,
                Known {
                    version: row.version,
                    schema,
                },
            )
        })
        .collect()
}
