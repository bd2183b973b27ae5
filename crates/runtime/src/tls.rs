//! A service's own HTTPS: the rustls server configuration (ring) of a
//! certificate and its key in PEM files, for the console, the gateway, the
//! operations endpoints (`http.tls_cert_file`, `http.tls_key_file`) and
//! remote-sim.

use std::sync::Arc;

use anyhow::Context;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// The server configuration of the certificate chain in `cert_file` and
/// its key in `key_file`, or `None` when both are empty (plain HTTP).
/// `section` names the settings in errors (`http`, `sim`). No ALPN: the
/// caller says which protocols it serves.
///
/// # Errors
/// One file without the other, a file that cannot be read, holds no PEM
/// certificate or key, or a key that is not the certificate's.
pub fn server_config(
    section: &str,
    cert_file: &str,
    key_file: &str,
) -> anyhow::Result<Option<rustls::ServerConfig>> {
    match (cert_file.is_empty(), key_file.is_empty()) {
        (true, true) => return Ok(None),
        (false, false) => {}
        _ => anyhow::bail!(
            "{section}.tls_cert_file and {section}.tls_key_file go together: set both for HTTPS, or neither"
        ),
    }
    let read = |key: &str, path: &str| {
        std::fs::read(path).with_context(|| format!("{section}.{key}: cannot read {path:?}"))
    };
    let certs = CertificateDer::pem_slice_iter(&read("tls_cert_file", cert_file)?)
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("{section}.tls_cert_file: {cert_file:?} is not PEM"))?;
    anyhow::ensure!(
        !certs.is_empty(),
        "{section}.tls_cert_file: {cert_file:?} holds no certificate"
    );
    let key =
        PrivateKeyDer::from_pem_slice(&read("tls_key_file", key_file)?).with_context(|| {
            format!(
                "{section}.tls_key_file: {key_file:?} holds no PEM private key (PKCS#8, PKCS#1 or SEC1)"
            )
        })?;
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_no_client_auth()
    .with_single_cert(certs, key)
    .with_context(|| format!("{section}.tls_cert_file and {section}.tls_key_file do not match"))?;
    Ok(Some(config))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_files_is_plain_http_and_one_without_the_other_is_refused() {
        assert!(server_config("http", "", "").unwrap().is_none());
        let error = server_config("http", "/x.pem", "").unwrap_err().to_string();
        assert!(
            error.contains("http.tls_cert_file and http.tls_key_file go together"),
            "{error}"
        );
        let error = server_config("http", "/no/such.pem", "/no/such.key")
            .unwrap_err()
            .to_string();
        assert!(error.contains("http.tls_cert_file: cannot read"), "{error}");
    }
}
