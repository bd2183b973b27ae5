//! A TLS front for a plain TCP server (RabbitMQ's 5672): what a broker's
//! TLS listener is to its clients, so that the services' `amqps://` side
//! (the handshake, the CA they trust, the host name they check) is tested
//! against the shared broker, which itself speaks plain AMQP. Counts the
//! handshakes it completed.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::{TcpListener, TcpStream};

/// A running TLS front (stopped when dropped).
pub struct TlsProxy {
    /// Its port on 127.0.0.1.
    pub port: u16,
    handshakes: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl TlsProxy {
    /// Serves TLS with the PEM certificate `cert_pem` and key `key_pem`
    /// on a free port, forwarding each connection's plaintext to
    /// `upstream`.
    ///
    /// # Panics
    /// When the certificate or key is not PEM, or no port can be bound.
    pub async fn start(cert_pem: &str, key_pem: &str, upstream: SocketAddr) -> Self {
        crate::install_crypto_provider();
        let certs = CertificateDer::pem_slice_iter(cert_pem.as_bytes())
            .collect::<Result<Vec<_>, _>>()
            .expect("a PEM certificate");
        let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).expect("a PEM key");
        let config = rustls::ServerConfig::builder()
            .with_no_client_auth()
            .with_single_cert(certs, key)
            .expect("a server configuration");
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("its address").port();
        let handshakes = Arc::new(AtomicUsize::new(0));
        let counted = handshakes.clone();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let acceptor = acceptor.clone();
                let counted = counted.clone();
                tokio::spawn(async move {
                    let Ok(mut client) = acceptor.accept(client).await else {
                        return;
                    };
                    counted.fetch_add(1, Ordering::SeqCst);
                    if let Ok(mut server) = TcpStream::connect(upstream).await {
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                    }
                });
            }
        });
        Self {
            port,
            handshakes,
            task,
        }
    }

    /// How many TLS handshakes it has completed.
    pub fn handshakes(&self) -> usize {
        self.handshakes.load(Ordering::SeqCst)
    }
}

impl Drop for TlsProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}
