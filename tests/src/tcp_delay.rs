//! A TCP proxy that slows every exchange down: each chunk read from either
//! side is passed on after a fixed delay (in order: a slow link, not a
//! lossy one). Put between a service and Postgres, it stretches every round
//! trip, so that a test can catch the service between two statements of a
//! transaction, as a process stopped there would be. It can also be the
//! route to whichever Postgres is primary, as HAProxy is: new connections
//! go to the upstream it was last pointed at ([`DelayProxy::point_at`]),
//! and [`DelayProxy::cut`] closes those open, as a failover does.

use std::time::Duration;

use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// A running delaying proxy; it stops accepting when dropped.
pub struct DelayProxy {
    /// The port it listens on (127.0.0.1).
    pub port: u16,
    upstream: Arc<Mutex<String>>,
    cuts: watch::Sender<u64>,
    accept: tokio::task::JoinHandle<()>,
}

impl DelayProxy {
    /// Starts a proxy on a free port of 127.0.0.1 to `upstream`
    /// (`host:port`), delaying each chunk by `delay` each way.
    ///
    /// # Panics
    /// When no port can be bound.
    pub async fn start(upstream: &str, delay: Duration) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("local address").port();
        let upstream = Arc::new(Mutex::new(upstream.to_owned()));
        let cuts = watch::Sender::new(0);
        let (target, watching) = (upstream.clone(), cuts.clone());
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let upstream = target.lock().expect("the upstream").clone();
                let mut cut = watching.subscribe();
                cut.mark_unchanged();
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(&upstream).await else {
                        return;
                    };
                    let _ = client.set_nodelay(true);
                    let _ = server.set_nodelay(true);
                    let (client_read, client_write) = client.into_split();
                    let (server_read, server_write) = server.into_split();
                    tokio::select! {
                        () = relay(client_read, server_write, delay) => {}
                        () = relay(server_read, client_write, delay) => {}
                        _ = cut.changed() => {}
                    }
                });
            }
        });
        Self {
            port,
            upstream,
            cuts,
            accept,
        }
    }

    /// New connections go to `upstream` (`host:port`) from now on.
    ///
    /// # Panics
    /// When a thread panicked holding the upstream.
    pub fn point_at(&self, upstream: &str) {
        *self.upstream.lock().expect("the upstream") = upstream.to_owned();
    }

    /// Closes every connection open through the proxy (new ones are
    /// accepted).
    pub fn cut(&self) {
        self.cuts.send_modify(|cuts| *cuts += 1);
    }

    /// `url` (a Postgres URL) pointed at the proxy instead of its host.
    ///
    /// # Panics
    /// When the URL has no `@host:port/`.
    pub fn postgres_url(&self, url: &str) -> String {
        let at = url.rfind('@').expect("a URL with user@host");
        let slash = url[at..].find('/').expect("a URL with a database") + at;
        format!("{}@127.0.0.1:{}{}", &url[..at], self.port, &url[slash..])
    }
}

impl Drop for DelayProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// Copies `from` to `to`, each chunk after `delay`, in order, until either
/// side closes.
async fn relay(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    delay: Duration,
) {
    let (sender, mut receiver) =
        tokio::sync::mpsc::unbounded_channel::<(tokio::time::Instant, Vec<u8>)>();
    let read = async move {
        let mut buffer = vec![0u8; 16 * 1024];
        loop {
            match from.read(&mut buffer).await {
                Ok(0) | Err(_) => return,
                Ok(read) => {
                    let due = tokio::time::Instant::now() + delay;
                    if sender.send((due, buffer[..read].to_vec())).is_err() {
                        return;
                    }
                }
            }
        }
    };
    let write = async move {
        while let Some((due, bytes)) = receiver.recv().await {
            tokio::time::sleep_until(due).await;
            if to.write_all(&bytes).await.is_err() {
                return;
            }
        }
    };
    tokio::join!(read, write);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn every_chunk_arrives_in_order_and_late() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let upstream = listener.local_addr().unwrap().to_string();
        let echo = tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            let mut buffer = [0u8; 64];
            let read = stream.read(&mut buffer).await.unwrap();
            stream.write_all(&buffer[..read]).await.unwrap();
        });
        let proxy = DelayProxy::start(&upstream, Duration::from_millis(150)).await;
        let mut client = TcpStream::connect(("127.0.0.1", proxy.port)).await.unwrap();
        let started = std::time::Instant::now();
        client.write_all(b"ping").await.unwrap();
        let mut answer = [0u8; 4];
        client.read_exact(&mut answer).await.unwrap();
        assert_eq!(&answer, b"ping");
        // Once each way.
        assert!(
            started.elapsed() >= Duration::from_millis(300),
            "{:?}",
            started.elapsed()
        );
        echo.await.unwrap();
        assert_eq!(
            proxy.postgres_url("postgres://u:p@127.0.0.1:5432/db"),
            format!("postgres://u:p@127.0.0.1:{}/db", proxy.port)
        );
    }
}
