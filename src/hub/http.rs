//! The hub client: one POST of a JSON body, the status code back, over
//! hyper on a connection kept alive between reports (TLS with rustls for
//! `https://`, the system's roots or the hub's `ca_file`). A bearer token
//! never travels in clear beyond loopback: an `http://` hub that is not on
//! loopback is refused at start when a token is configured.

use std::sync::Arc;
use std::time::Duration;

use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Bytes;
use hyper::client::conn::http1::SendRequest;

use crate::net::client::Origin;

#[derive(Debug, thiserror::Error)]
pub enum PostError {
    #[error("hub url must be http(s)://host[:port][/path]")]
    BadUrl,
    #[error("connection failed")]
    Connect,
    #[error("timed out")]
    Timeout,
    #[error("malformed response")]
    Malformed,
}

/// One hub's client: its URL, TLS settings and the connection kept alive.
pub struct Client {
    url: Origin,
    tls: Option<Arc<rustls::ClientConfig>>,
    conn: tokio::sync::Mutex<Option<SendRequest<Full<Bytes>>>>,
}

impl Client {
    pub fn new(url: &str, ca_file: Option<&std::path::Path>) -> Result<Client, String> {
        let url = Origin::parse(url)?;
        let tls = match url.tls {
            true => Some(crate::net::client::tls_config(ca_file)?),
            false => None,
        };
        Ok(Client { url, tls, conn: tokio::sync::Mutex::new(None) })
    }

    /// POSTs `body` to `path` (under the URL's path); the status code.
    pub async fn post_json(
        &self,
        path: &str,
        bearer: Option<&str>,
        body: &[u8],
        timeout: Duration,
    ) -> Result<u16, PostError> {
        tokio::time::timeout(timeout, self.exchange(path, bearer, body, timeout))
            .await
            .map_err(|_| PostError::Timeout)?
    }

    async fn exchange(
        &self,
        path: &str,
        bearer: Option<&str>,
        body: &[u8],
        timeout: Duration,
    ) -> Result<u16, PostError> {
        let mut conn = self.conn.lock().await;
        // A kept connection the hub closed is noticed here or by the send
        // failing: then once more on a fresh one.
        for fresh in [false, true] {
            let reuse = !fresh && conn.as_mut().is_some_and(|s| !s.is_closed());
            if !reuse {
                *conn = None;
                let stream = crate::net::client::connect(&self.url.host, self.url.port, self.tls.as_ref(), timeout)
                    .await
                    .map_err(|_| PostError::Connect)?;
                *conn = Some(crate::net::client::handshake(stream).await.map_err(|_| PostError::Connect)?);
            }
            let Some(sender) = conn.as_mut() else { return Err(PostError::Connect) };
            if sender.ready().await.is_err() {
                *conn = None;
                continue;
            }
            let mut request = hyper::Request::post(format!("{}{path}", self.url.path))
                .header(hyper::header::HOST, self.url.authority())
                .header(hyper::header::CONTENT_TYPE, "application/cloudevents+json");
            if let Some(token) = bearer {
                let mut value = hyper::header::HeaderValue::from_str(&format!("Bearer {token}"))
                    .map_err(|_| PostError::Malformed)?;
                value.set_sensitive(true);
                request = request.header(hyper::header::AUTHORIZATION, value);
            }
            let request = request.body(Full::new(Bytes::copy_from_slice(body))).map_err(|_| PostError::BadUrl)?;
            match sender.send_request(request).await {
                Ok(response) => {
                    let status = response.status().as_u16();
                    // Read to its end (at most 64 KiB), so the connection
                    // can carry the next report.
                    let _ = Limited::new(response.into_body(), 64 << 10).collect().await;
                    return Ok(status);
                }
                Err(_) if reuse => *conn = None,
                Err(_) => {
                    *conn = None;
                    return Err(PostError::Connect);
                }
            }
        }
        Err(PostError::Connect)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse_into_scheme_host_port_and_path() {
        let plain = Origin::parse("http://hub:8080/base").unwrap();
        assert_eq!(plain, Origin { tls: false, host: "hub".into(), port: 8080, path: "/base".into() });
        let tls = Origin::parse("https://hub.example").unwrap();
        assert_eq!((tls.tls, tls.port, tls.path.as_str()), (true, 443, ""));
        assert!(plain.is_clear_beyond_loopback() && !tls.is_clear_beyond_loopback());
        assert!(!Origin::parse("http://127.0.0.1:1").unwrap().is_clear_beyond_loopback());
        assert!(Origin::parse("ftp://hub").is_err());
        assert!(Origin::parse("http://user:pw@hub").is_err());
    }
}
