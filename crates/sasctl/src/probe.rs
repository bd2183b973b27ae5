//! `sasctl probe URL`: a minimal HTTP GET for container health checks.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Splits `http://host:port/path` into (`host:port`, `/path`).
fn split(url: &str) -> anyhow::Result<(String, String)> {
    let rest = url
        .strip_prefix("http://")
        .with_context(|| format!("{url:?} is not an http:// URL"))?;
    let (authority, path) = match rest.find('/') {
        Some(slash) => (&rest[..slash], &rest[slash..]),
        None => (rest, "/"),
    };
    let authority = if authority.contains(':') {
        authority.to_owned()
    } else {
        format!("{authority}:80")
    };
    Ok((authority, path.to_owned()))
}

/// GETs `url`; exit 0 on a 200 answer, 1 on anything else.
///
/// # Errors
/// When the URL is not an `http://` URL.
pub async fn run(url: &str) -> anyhow::Result<ExitCode> {
    let (authority, path) = split(url)?;
    let request = async {
        let mut stream = tokio::net::TcpStream::connect(&authority).await?;
        stream
            .write_all(format!("GET {path} HTTP/1.0\r\nHost: {authority}\r\n\r\n").as_bytes())
            .await?;
        let mut head = [0u8; 32];
        let read = stream.read(&mut head).await?;
        Ok::<_, std::io::Error>(String::from_utf8_lossy(&head[..read]).into_owned())
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
    use super::split;

    #[test]
    fn urls_split_into_authority_and_path() {
        assert_eq!(
            split("http://127.0.0.1:9101/readyz").unwrap(),
            ("127.0.0.1:9101".to_owned(), "/readyz".to_owned())
        );
        assert_eq!(
            split("http://sim").unwrap(),
            ("sim:80".to_owned(), "/".to_owned())
        );
        assert!(split("https://x").is_err());
    }
}
