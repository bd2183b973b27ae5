//! Structured logs, and spans exported over OTLP when `log.otlp_endpoint`
//! is set.
//!
//! Every message about an order carries the order's trace id in its
//! `traceparent` header (`sas_messages::TraceParent`), so each service can
//! put the spans of its work on an order into the order's trace
//! ([`join_trace`]): intake, each dispatch, the agent's call (whose
//! `traceparent` goes on to the remote service) and the reply, through
//! compensation, make one trace per order across every service.

use std::sync::OnceLock;

use opentelemetry::trace::{
    SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState, TracerProvider as _,
};
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::Resource;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;
use tracing_subscriber::{fmt, EnvFilter, Layer as _};

use crate::settings::{LogFormat, LogSettings};

/// The TLS verifier reqwest uses logs an error of its own, without the URL,
/// for every certificate it refuses; the agent logs one line with the URL
/// and the verifier's reason for each, so the verifier's is muted unless
/// the filter names it.
const QUIET_VERIFIER: &str = "rustls_platform_verifier=off";

/// The span exporter, kept to flush it at exit.
static PROVIDER: OnceLock<SdkTracerProvider> = OnceLock::new();

/// Installs the global log subscriber (`RUST_LOG` overrides the configured
/// filter) and, when `log.otlp_endpoint` is set, the span exporter of the
/// service `name`.
///
/// # Errors
/// When the filter does not parse or the endpoint is not a URL.
pub fn init(settings: &LogSettings, name: &str) -> anyhow::Result<()> {
    let text = match std::env::var("RUST_LOG") {
        Ok(value) if !value.is_empty() => value,
        _ => settings.filter.clone(),
    };
    let mut filter = EnvFilter::try_new(&text)
        .map_err(|e| anyhow::anyhow!("log.filter is not a valid filter: {e}"))?;
    if !text.contains("rustls_platform_verifier") {
        filter = filter.add_directive(QUIET_VERIFIER.parse()?);
    }
    let logs = match settings.format {
        LogFormat::Text => fmt::layer().with_writer(std::io::stderr).boxed(),
        LogFormat::Json => fmt::layer()
            .with_writer(std::io::stderr)
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .boxed(),
    };
    let spans = if settings.otlp_endpoint.is_empty() {
        None
    } else {
        let endpoint = format!("{}/v1/traces", settings.otlp_endpoint.trim_end_matches('/'));
        // The exporter's HTTP client (reqwest on rustls) needs it.
        crate::install_crypto_provider();
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpJson)
            .with_endpoint(&endpoint)
            .build()
            .map_err(|e| anyhow::anyhow!("log.otlp_endpoint {endpoint}: {e}"))?;
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_resource(
                Resource::builder()
                    .with_service_name(name.to_owned())
                    .build(),
            )
            .build();
        let tracer = provider.tracer(name.to_owned());
        let _ = PROVIDER.set(provider);
        Some(tracing_opentelemetry::layer().with_tracer(tracer))
    };
    tracing_subscriber::registry()
        .with(filter)
        .with(logs)
        .with(spans)
        .try_init()
        .map_err(|e| anyhow::anyhow!("cannot install the log subscriber: {e}"))
}

/// Sends the spans not exported yet; called as the service exits.
pub fn flush() {
    if let Some(provider) = PROVIDER.get() {
        if let Err(error) = provider.shutdown() {
            eprintln!("spans not exported at exit: {error}");
        }
    }
}

/// Puts `span` into the trace `trace_id` (32 hex digits), as a child of the
/// remote span `parent_span_id` (16 hex digits; the hop that sent the
/// message). Does nothing with ids that do not parse, or without an
/// exporter.
pub fn join_trace(span: &tracing::Span, trace_id: &str, parent_span_id: &str) {
    let (Ok(trace), Ok(parent)) = (
        TraceId::from_hex(trace_id),
        SpanId::from_hex(parent_span_id),
    ) else {
        return;
    };
    if PROVIDER.get().is_none() || trace == TraceId::INVALID || parent == SpanId::INVALID {
        return;
    }
    let remote = SpanContext::new(
        trace,
        parent,
        TraceFlags::SAMPLED,
        true,
        TraceState::default(),
    );
    let _ = span.set_parent(opentelemetry::Context::new().with_remote_span_context(remote));
}

/// The `traceparent` of a call made within the current span, when spans
/// are exported: its trace and span ids, so the callee's spans are its
/// children. `None` without an exporter or outside a span of a trace.
pub fn current_traceparent() -> Option<String> {
    PROVIDER.get()?;
    let context = tracing::Span::current().context();
    let span = context.span();
    let span_context = span.span_context();
    span_context.is_valid().then(|| {
        format!(
            "00-{}-{}-01",
            span_context.trace_id(),
            span_context.span_id()
        )
    })
}
