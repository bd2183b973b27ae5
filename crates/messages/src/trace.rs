//! W3C trace context (`traceparent`) carried in AMQP headers, so that one
//! order's log lines and spans join up across the scheduler, the agents and
//! the client: every message about an order carries the order's trace id.

use std::fmt;

/// A parsed `traceparent` header: `00-<trace id>-<parent span id>-<flags>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceParent {
    /// 32 lower-case hex digits, the same for every message of one order.
    pub trace_id: String,
    /// 16 lower-case hex digits, new for every hop.
    pub span_id: String,
    /// Trace flags (`01` = sampled).
    pub flags: String,
}

fn is_hex(text: &str, len: usize) -> bool {
    text.len() == len && text.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

fn random_hex(bytes: usize) -> String {
    let mut out = String::with_capacity(bytes * 2);
    while out.len() < bytes * 2 {
        out.push_str(&uuid::Uuid::new_v4().simple().to_string());
    }
    out.truncate(bytes * 2);
    out
}

impl TraceParent {
    /// Parses a header value; `None` unless it is a valid version-00 traceparent.
    pub fn parse(header: &str) -> Option<Self> {
        let mut parts = header.trim().split('-');
        let (version, trace_id, span_id, flags) =
            (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        let valid = version == "00"
            && parts.next().is_none()
            && is_hex(trace_id, 32)
            && trace_id != "0".repeat(32)
            && is_hex(span_id, 16)
            && span_id != "0".repeat(16)
            && is_hex(flags, 2);
        valid.then(|| Self {
            trace_id: trace_id.to_owned(),
            span_id: span_id.to_owned(),
            flags: flags.to_owned(),
        })
    }

    /// A new trace (for an order whose client sent no trace context).
    pub fn new_root() -> Self {
        Self {
            trace_id: random_hex(16),
            span_id: random_hex(8),
            flags: "01".into(),
        }
    }

    /// The context of the next hop of trace `trace_id`: same trace, new span.
    pub fn child_of(trace_id: &str) -> Self {
        Self {
            trace_id: trace_id.to_owned(),
            span_id: random_hex(8),
            flags: "01".into(),
        }
    }
}

impl fmt::Display for TraceParent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "00-{}-{}-{}", self.trace_id, self.span_id, self.flags)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_valid_traceparent_round_trips() {
        let header = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let parsed = TraceParent::parse(header).unwrap();
        assert_eq!(parsed.trace_id, "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(parsed.to_string(), header);
    }

    #[test]
    fn malformed_or_all_zero_contexts_are_refused() {
        for bad in [
            "",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
        ] {
            assert!(TraceParent::parse(bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn a_child_keeps_the_trace_and_gets_a_new_span() {
        let root = TraceParent::new_root();
        let child = TraceParent::child_of(&root.trace_id);
        assert_eq!(child.trace_id, root.trace_id);
        assert_ne!(child.span_id, root.span_id);
        assert!(TraceParent::parse(&child.to_string()).is_some());
    }
}
