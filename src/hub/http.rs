//! The smallest HTTP/1.1 client that does the job: one POST of a JSON body,
//! `Connection: close`, and the status code back. Plain `http://` only; a
//! hub behind TLS needs a terminating proxy on the daemon's host.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

#[derive(Debug, thiserror::Error)]
pub enum PostError {
    #[error("hub url must be http://host[:port][/path]")]
    BadUrl,
    #[error("connection failed")]
    Connect,
    #[error("timed out")]
    Timeout,
    #[error("malformed response")]
    Malformed,
}

/// `(host:port, path)` of an `http://` URL.
pub fn split_url(url: &str) -> Result<(String, String), PostError> {
    let rest = url.strip_prefix("http://").ok_or(PostError::BadUrl)?;
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    if authority.is_empty() || authority.contains('@') {
        return Err(PostError::BadUrl);
    }
    let authority = if authority.contains(':') { authority.to_string() } else { format!("{authority}:80") };
    Ok((authority, path.to_string()))
}

pub async fn post_json(url: &str, bearer: Option<&str>, body: &[u8], timeout: Duration) -> Result<u16, PostError> {
    let (authority, path) = split_url(url)?;
    let exchange = async {
        let mut stream = TcpStream::connect(&authority).await.map_err(|_| PostError::Connect)?;
        let mut head = format!(
            "POST {path} HTTP/1.1\r\nHost: {authority}\r\nContent-Type: application/cloudevents+json\r\nContent-Length: {}\r\nConnection: close\r\n",
            body.len()
        );
        if let Some(token) = bearer {
            head.push_str(&format!("Authorization: Bearer {token}\r\n"));
        }
        head.push_str("\r\n");
        stream.write_all(head.as_bytes()).await.map_err(|_| PostError::Connect)?;
        stream.write_all(body).await.map_err(|_| PostError::Connect)?;
        let mut response = Vec::new();
        let mut buf = [0u8; 1024];
        // The status line is all we need.
        while !response.windows(2).any(|w| w == b"\r\n") && response.len() < 8192 {
            let n = stream.read(&mut buf).await.map_err(|_| PostError::Malformed)?;
            if n == 0 {
                break;
            }
            response.extend_from_slice(&buf[..n]);
        }
        let line = String::from_utf8_lossy(&response);
        let mut parts = line.split_whitespace();
        match (parts.next(), parts.next().and_then(|c| c.parse::<u16>().ok())) {
            (Some(version), Some(code)) if version.starts_with("HTTP/1.") => Ok(code),
            _ => Err(PostError::Malformed),
        }
    };
    tokio::time::timeout(timeout, exchange).await.map_err(|_| PostError::Timeout)?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_split_into_authority_and_path() {
        assert_eq!(split_url("http://hub:8080/base").unwrap(), ("hub:8080".into(), "/base".into()));
        assert_eq!(split_url("http://hub").unwrap(), ("hub:80".into(), "/".into()));
        assert!(split_url("https://hub").is_err());
        assert!(split_url("http://user:pw@hub").is_err());
    }
}
