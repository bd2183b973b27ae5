//! A TCP proxy in front of RabbitMQ that can lose a connection at the worst
//! moment: after the broker took a publish, before its confirm is back.
//!
//! Bytes from the client go to the broker unchanged. Bytes from the broker
//! are read frame by frame (AMQP 0-9-1: a 7-byte header with the type, the
//! channel and the payload size, the payload, the end octet `0xCE`), so that
//! [`AmqpProxy::swallow_confirms`] can drop `basic.ack` and `basic.nack`
//! frames going to the client (from a broker they are publisher confirms,
//! nothing else) while deliveries and everything else pass;
//! [`AmqpProxy::nack_confirms`] turns the broker's `basic.ack` into
//! `basic.nack` (what a quorum queue without a leader answers);
//! [`AmqpProxy::drop_from_clients`] drops what clients send, whole frames at
//! a time, and [`AmqpProxy::dropped_publishes`] names where each dropped
//! `basic.publish` was going, so that a test waits for the very publish it
//! means to lose rather than for a row written before it. [`AmqpProxy::cut`]
//! closes every connection open through the proxy, as a dying node does.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// A running proxy; it stops when dropped.
pub struct AmqpProxy {
    /// The port it listens on (127.0.0.1).
    pub port: u16,
    state: Arc<State>,
    accept: tokio::task::JoinHandle<()>,
}

struct State {
    swallow: AtomicBool,
    nack: AtomicBool,
    nacked: AtomicUsize,
    drop_upstream: AtomicBool,
    dropped_publishes: Mutex<Vec<String>>,
    swallowed: AtomicUsize,
    connections: AtomicUsize,
    cuts: watch::Sender<u64>,
}

impl AmqpProxy {
    /// Starts a proxy on a free port of 127.0.0.1 to the broker of `amqp_url`.
    ///
    /// # Panics
    /// When the URL does not parse or no port can be bound.
    pub async fn start(amqp_url: &str) -> Self {
        let uri: sas_broker::lapin::uri::AMQPUri = amqp_url.parse().expect("an AMQP URL");
        let upstream = format!("{}:{}", uri.authority.host, uri.authority.port);
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("local address").port();
        let state = Arc::new(State {
            swallow: AtomicBool::new(false),
            nack: AtomicBool::new(false),
            nacked: AtomicUsize::new(0),
            drop_upstream: AtomicBool::new(false),
            dropped_publishes: Mutex::new(Vec::new()),
            swallowed: AtomicUsize::new(0),
            connections: AtomicUsize::new(0),
            cuts: watch::Sender::new(0),
        });
        let accept = tokio::spawn(accept_loop(listener, upstream, state.clone()));
        Self {
            port,
            state,
            accept,
        }
    }

    /// `amqp_url` pointed at the proxy instead of the broker.
    pub fn url(&self, amqp_url: &str) -> String {
        url_at(amqp_url, self.port)
    }

    /// From now on, drop (`true`) or pass (`false`) the publisher confirms
    /// the broker sends through the proxy.
    pub fn swallow_confirms(&self, swallow: bool) {
        self.state.swallow.store(swallow, Ordering::SeqCst);
    }

    /// From now on, turn (`true`) the broker's positive publisher confirms
    /// into negative ones, or pass them (`false`).
    pub fn nack_confirms(&self, nack: bool) {
        self.state.nack.store(nack, Ordering::SeqCst);
    }

    /// Positive confirms turned into negative ones so far.
    pub fn confirms_nacked(&self) -> usize {
        self.state.nacked.load(Ordering::SeqCst)
    }

    /// From now on, drop (`true`) or pass (`false`) everything the clients
    /// send: their publishes never reach the broker (nor their acks), as
    /// when a node dies with them unread. Cut the connections after.
    pub fn drop_from_clients(&self, drop: bool) {
        self.state.drop_upstream.store(drop, Ordering::SeqCst);
    }

    /// The routing key of every `basic.publish` dropped so far, in order:
    /// a request to an agent names its queue. A row the client stored
    /// before publishing says nothing of whether the publish was sent yet;
    /// this does.
    pub fn dropped_publishes(&self) -> Vec<String> {
        self.state
            .dropped_publishes
            .lock()
            .expect("the proxy's list of dropped publishes")
            .clone()
    }

    /// Confirm frames dropped so far.
    pub fn confirms_swallowed(&self) -> usize {
        self.state.swallowed.load(Ordering::SeqCst)
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> usize {
        self.state.connections.load(Ordering::SeqCst)
    }

    /// Closes every connection open through the proxy (new ones are accepted).
    pub fn cut(&self) {
        self.state.cuts.send_modify(|cuts| *cuts += 1);
    }
}

impl Drop for AmqpProxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.cut();
    }
}

/// `amqp_url` (user, password, vhost, heartbeat) pointed at 127.0.0.1:`port`.
///
/// # Panics
/// When the URL does not parse.
pub fn url_at(amqp_url: &str, port: u16) -> String {
    let uri: sas_broker::lapin::uri::AMQPUri = amqp_url.parse().expect("an AMQP URL");
    let (user, password) = (
        &uri.authority.userinfo.username,
        &uri.authority.userinfo.password,
    );
    let vhost = if uri.vhost == "/" {
        "%2f".to_owned()
    } else {
        uri.vhost.clone()
    };
    let heartbeat = uri
        .query
        .heartbeat
        .map(|h| format!("?heartbeat={h}"))
        .unwrap_or_default();
    format!("amqp://{user}:{password}@127.0.0.1:{port}/{vhost}{heartbeat}")
}

async fn accept_loop(listener: TcpListener, upstream: String, state: Arc<State>) {
    while let Ok((client, _)) = listener.accept().await {
        let (upstream, state) = (upstream.clone(), state.clone());
        tokio::spawn(async move {
            let Ok(broker) = TcpStream::connect(&upstream).await else {
                return;
            };
            state.connections.fetch_add(1, Ordering::SeqCst);
            let mut cuts = state.cuts.subscribe();
            cuts.mark_unchanged();
            tokio::select! {
                () = relay(client, broker, &state) => {}
                _ = cuts.changed() => {}
            }
        });
    }
}

/// Relays both ways until either side closes; the sockets close when dropped.
async fn relay(client: TcpStream, broker: TcpStream, state: &State) {
    let (mut client_read, mut client_write) = client.into_split();
    let (mut broker_read, mut broker_write) = broker.into_split();
    let up = async {
        // The protocol header ("AMQP" 0 0 9 1) comes before the first frame.
        let mut header_left = 8;
        let mut pending: Vec<u8> = Vec::new();
        let mut buffer = [0u8; 16 * 1024];
        loop {
            let read = match client_read.read(&mut buffer).await {
                Ok(0) | Err(_) => return,
                Ok(read) => read,
            };
            pending.extend_from_slice(&buffer[..read]);
            let mut out = Vec::with_capacity(pending.len());
            let mut at = header_left.min(pending.len());
            out.extend_from_slice(&pending[..at]);
            header_left -= at;
            while let Some(len) = frame_len(&pending[at..]).filter(|_| header_left == 0) {
                let frame = &pending[at..at + len];
                if !state.drop_upstream.load(Ordering::SeqCst) {
                    out.extend_from_slice(frame);
                } else if let Some(routing_key) = publish_routing_key(frame) {
                    state
                        .dropped_publishes
                        .lock()
                        .expect("the proxy's list of dropped publishes")
                        .push(routing_key);
                }
                at += len;
            }
            pending.drain(..at);
            if broker_write.write_all(&out).await.is_err() {
                return;
            }
        }
    };
    let down = async {
        let mut pending: Vec<u8> = Vec::new();
        let mut buffer = [0u8; 16 * 1024];
        loop {
            let read = match broker_read.read(&mut buffer).await {
                Ok(0) | Err(_) => return,
                Ok(read) => read,
            };
            pending.extend_from_slice(&buffer[..read]);
            let mut out = Vec::with_capacity(pending.len());
            let mut at = 0;
            while let Some(len) = frame_len(&pending[at..]) {
                let frame = &pending[at..at + len];
                if state.swallow.load(Ordering::SeqCst) && is_confirm(frame) {
                    state.swallowed.fetch_add(1, Ordering::SeqCst);
                } else if state.nack.load(Ordering::SeqCst) && is_ack(frame) {
                    // basic.nack has the same arguments' size: delivery tag, bits.
                    out.extend_from_slice(&frame[..9]);
                    out.extend_from_slice(&[0, 120]);
                    out.extend_from_slice(&frame[11..]);
                    state.nacked.fetch_add(1, Ordering::SeqCst);
                } else {
                    out.extend_from_slice(frame);
                }
                at += len;
            }
            pending.drain(..at);
            if client_write.write_all(&out).await.is_err() {
                return;
            }
        }
    };
    tokio::select! {
        () = up => {}
        () = down => {}
    }
}

/// The length of the whole frame at the start of `bytes`, once it is all there.
fn frame_len(bytes: &[u8]) -> Option<usize> {
    let header: [u8; 7] = bytes.get(..7)?.try_into().ok()?;
    let size = u32::from_be_bytes([header[3], header[4], header[5], header[6]]) as usize;
    let len = 7 + size + 1;
    (bytes.len() >= len).then_some(len)
}

/// A method frame of `basic.ack` (60, 80) or `basic.nack` (60, 120).
fn is_confirm(frame: &[u8]) -> bool {
    is_ack(frame) || (frame[0] == 1 && frame.len() >= 11 && frame[7..11] == [0, 60, 0, 120])
}

/// The routing key of a method frame of `basic.publish` (60, 40): its
/// arguments are a reserved short, the exchange and the routing key (short
/// strings: a length octet, then the bytes).
fn publish_routing_key(frame: &[u8]) -> Option<String> {
    if frame[0] != 1 || frame.get(7..11)? != [0, 60, 0, 40] {
        return None;
    }
    let exchange_len = usize::from(*frame.get(13)?);
    let key_at = 14 + exchange_len;
    let key_len = usize::from(*frame.get(key_at)?);
    let key = frame.get(key_at + 1..key_at + 1 + key_len)?;
    Some(String::from_utf8_lossy(key).into_owned())
}

/// A method frame of `basic.ack` (60, 80).
fn is_ack(frame: &[u8]) -> bool {
    frame[0] == 1 && frame.len() >= 11 && frame[7..11] == [0, 60, 0, 80]
}

#[cfg(test)]
mod tests {
    use super::{frame_len, is_confirm, publish_routing_key};

    #[test]
    fn frames_are_cut_whole_and_confirms_recognised() {
        // basic.ack on channel 1: class 60, method 80, delivery tag, multiple.
        let mut ack = vec![1, 0, 1, 0, 0, 0, 13, 0, 60, 0, 80];
        ack.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 7, 0, 0xCE]);
        assert_eq!(frame_len(&ack), Some(ack.len()));
        assert!(is_confirm(&ack));
        assert_eq!(frame_len(&ack[..ack.len() - 1]), None);
        let heartbeat = [8, 0, 0, 0, 0, 0, 0, 0xCE];
        assert_eq!(frame_len(&heartbeat), Some(8));
        assert!(!is_confirm(&heartbeat));
        assert_eq!(publish_routing_key(&heartbeat), None);
        assert_eq!(publish_routing_key(&ack), None);
    }

    #[test]
    fn a_publish_names_its_routing_key() {
        // basic.publish on channel 1: reserved short, exchange "x",
        // routing key "sas.agent.payment", mandatory bit.
        let key = b"sas.agent.payment";
        let mut args = vec![0, 60, 0, 40, 0, 0, 1, b'x', key.len() as u8];
        args.extend_from_slice(key);
        args.push(1);
        let mut publish = vec![1, 0, 1];
        publish.extend_from_slice(&(args.len() as u32).to_be_bytes());
        publish.extend_from_slice(&args);
        publish.push(0xCE);
        assert_eq!(frame_len(&publish), Some(publish.len()));
        assert_eq!(
            publish_routing_key(&publish).as_deref(),
            Some("sas.agent.payment")
        );
        assert!(!is_confirm(&publish));
    }
}
