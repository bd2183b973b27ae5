//! `sasctl probe URL`: a minimal HTTP GET for container health checks,
//! over TLS for an `https://` URL (trusting `--ca-file`, a service's own
//! certificate's CA, as its clients do).

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// A URL as the probe reads it.
#[derive(Debug, PartialEq, Eq)]
struct Target {
    tls: bool,
    /// `host:port`.
    authority: String,
    host: String,
    path: String,
}

/// Splits `http://host:port/path` (or `https://`) into its parts.
fn split(url: &str) -> anyhow::Result<Target> {
    let (tls, rest, port) = if let Some(rest) = url.strip_prefix("http://") {
        (false, rest, 80)
    } else if let Some(rest) = url.strip_prefix("https://") {
        (true, rest, 443)
    } else {
        anyhow::bail!("{url:?} is not an http:// or https:// URL");
    };
    let (authority, path) = match rest.find('/') {
        Some(slash) => (&rest[..slash], &rest[slash..]),
        None => (rest, "/"),
    };
    let (host, authority) = match authority.rsplit_once(':') {
        Some((host, _)) => (host.to_owned(), authority.to_owned()),
        None => (authority.to_owned(), format!("{authority}:{port}")),
    };
    Ok(Target {
        tls,
        authority,
        host,
        path: path.to_owned(),
    })
}

/// The first bytes of the answer to `GET path` over `stream`.
async fn head<S: AsyncRead + AsyncWrite + Unpin>(
    mut stream: S,
    target: &Target,
) -> std::io::Result<String> {
    let request = format!(
        "GET {} HTTP/1.0\r\nHost: {}\r\n\r\n",
        target.path, target.authority
    );
    stream.write_all(request.as_bytes()).await?;
    // A TLS stream sends what it holds only when flushed.
    stream.flush().await?;
    let mut head = [0u8; 32];
    let read = stream.read(&mut head).await?;
    Ok(String::from_utf8_lossy(&head[..read]).into_owned())
}

/// A TLS client trusting the PEM CA in `ca_file`.
fn connector(ca_file: &str) -> anyhow::Result<tokio_rustls::TlsConnector> {
    let pem = std::fs::read(ca_file).with_context(|| format!("--ca-file {ca_file:?}"))?;
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(&pem) {
        roots
            .add(cert.with_context(|| format!("--ca-file {ca_file:?} is not PEM"))?)
            .with_context(|| format!("--ca-file {ca_file:?}"))?;
    }
    anyhow::ensure!(
        !roots.is_empty(),
        "--ca-file {ca_file:?} holds no certificate"
    );
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_root_certificates(roots)
    .with_no_client_auth();
    Ok(tokio_rustls::TlsConnector::from(Arc::new(config)))
}

/// GETs `url`; exit 0 on a 200 answer, 1 on anything else. An `https://`
/// URL needs `ca_file`, the CA of the service's certificate.
///
/// # Errors
/// When the URL is neither `http://` nor `https://`, or an `https://` one
/// comes without a readable CA.
pub async fn run(url: &str, ca_file: Option<&str>) -> anyhow::Result<ExitCode> {
    let target = split(url)?;
    let tls = match (target.tls, ca_file) {
        (false, _) => None,
        (true, Some(ca_file)) => Some((
            connector(ca_file)?,
            ServerName::try_from(target.host.clone())
                .with_context(|| format!("{url:?}: {:?} is no host name", target.host))?,
        )),
        (true, None) => {
            anyhow::bail!("{url:?} is https://: give the CA of its certificate with --ca-file")
        }
    };
    let request = async {
        let stream = tokio::net::TcpStream::connect(&target.authority).await?;
        match tls {
            None => head(stream, &target).await,
            Some((connector, name)) => head(connector.connect(name, stream).await?, &target).await,
        }
    };
    match tokio::time::timeout(Duration::from_secs(3), request).await {
        Ok(Ok(head)) if head.split_whitespace().nth(1) == Some("200") => Ok(ExitCode::SUCCESS),
        Ok(Ok(head)) => {
            eprintln!("{url}: {}", head.lines().next().unwrap_or(""));
            Ok(ExitCode::FAILURE)
        }
        Ok(Err(error)) => {
            eprintln!("{url}: {error}");
            Ok(ExitCode::FAILURE)
        }
        Err(_) => {
            eprintln!("{url}: no answer within 3 s");
            Ok(ExitCode::FAILURE)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{split, Target};

    #[test]
    fn urls_split_into_authority_and_path() {
        assert_eq!(
            split("http://127.0.0.1:9101/readyz").unwrap(),
            Target {
                tls: false,
                authority: "127.0.0.1:9101".into(),
                host: "127.0.0.1".into(),
                path: "/readyz".into()
            }
        );
        assert_eq!(
            split("http://sim").unwrap(),
            Target {
                tls: false,
                authority: "sim:80".into(),
                host: "sim".into(),
                path: "/".into()
            }
        );
        let https = split("https://console:9104/readyz").unwrap();
        assert!(https.tls);
        assert_eq!(
            (https.host.as_str(), https.authority.as_str()),
            ("console", "console:9104")
        );
        assert_eq!(split("https://x").unwrap().authority, "x:443");
        assert!(split("ftp://x").is_err());
    }
}
