//! The daemon's own outgoing HTTP/1.1 connections (the credential
//! gateway's upstreams, the hub): TCP, then TLS (rustls, ring) unless the
//! peer is a plain-HTTP loopback listener, then hyper.

use std::sync::Arc;
use std::time::Duration;

/// What a connection is read and written through: TCP or TLS over it.
pub trait Stream: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> Stream for T {}

/// Connects to `host:port`, with TLS when `tls` is given (the name checked
/// against the certificate is `host`). Errors name the peer, never a body.
pub async fn connect(
    host: &str,
    port: u16,
    tls: Option<&Arc<rustls::ClientConfig>>,
    timeout: Duration,
) -> Result<Box<dyn Stream>, String> {
    let peer = if host.contains(':') { format!("[{host}]:{port}") } else { format!("{host}:{port}") };
    let tcp = tokio::time::timeout(timeout, tokio::net::TcpStream::connect((host, port)))
        .await
        .map_err(|_| format!("connecting to {peer} timed out"))?
        .map_err(|e| format!("connecting to {peer}: {e}"))?;
    let _ = tcp.set_nodelay(true);
    let Some(config) = tls else { return Ok(Box::new(tcp)) };
    let name = rustls::pki_types::ServerName::try_from(host.to_string()).map_err(|e| format!("{peer}: {e}"))?;
    let stream = tokio::time::timeout(timeout, tokio_rustls::TlsConnector::from(config.clone()).connect(name, tcp))
        .await
        .map_err(|_| format!("TLS with {peer} timed out"))?
        .map_err(|e| format!("TLS with {peer}: {e}"))?;
    Ok(Box::new(stream))
}

/// An HTTP/1.1 client connection over `stream`; its driver runs on a task
/// of its own until either side closes.
pub async fn handshake<B>(stream: Box<dyn Stream>) -> Result<hyper::client::conn::http1::SendRequest<B>, String>
where
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let (sender, connection) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
        .await
        .map_err(|e| format!("handshake: {e}"))?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(sender)
}

/// The TLS client settings: the system's roots, or `ca_file`'s alone.
pub fn tls_config(ca_file: Option<&std::path::Path>) -> Result<Arc<rustls::ClientConfig>, String> {
    let roots = roots(ca_file.unwrap_or(std::path::Path::new(SYSTEM_ROOTS)))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Arc::new(config))
}

/// The system's CA bundle, the roots when no `ca_file` is named.
const SYSTEM_ROOTS: &str = "/etc/ssl/certs/ca-certificates.crt";

/// TLS client settings from a CA file, read again whenever the file
/// changes (its length, modification time or inode): a rotated or revoked
/// CA holds from the next connection on, however long the holder (a warm
/// sandbox's gateway, a session's) has lived. Reading it costs a `stat`
/// per connection.
pub struct TlsSource {
    path: std::path::PathBuf,
    cached: std::sync::Mutex<(FileStamp, Arc<rustls::ClientConfig>)>,
}

/// What tells a file's contents changed, short of reading them.
#[derive(Clone, Copy, PartialEq, Eq)]
struct FileStamp {
    len: u64,
    modified: Option<std::time::SystemTime>,
    ino: u64,
}

fn stamp(path: &std::path::Path) -> Result<FileStamp, String> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(path).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(FileStamp { len: meta.len(), modified: meta.modified().ok(), ino: meta.ino() })
}

impl TlsSource {
    /// `ca_file`'s roots alone, or the system's; read now, so a file that
    /// cannot be used is an error here.
    pub fn new(ca_file: Option<&std::path::Path>) -> Result<TlsSource, String> {
        let path = ca_file.unwrap_or(std::path::Path::new(SYSTEM_ROOTS)).to_path_buf();
        let stamped = (stamp(&path)?, tls_config(Some(&path))?);
        Ok(TlsSource { path, cached: std::sync::Mutex::new(stamped) })
    }

    /// The settings for a connection now: read again if the file changed
    /// since; an error (the file is gone, or holds no certificate) is not
    /// papered over with the settings of before.
    pub fn config(&self) -> Result<Arc<rustls::ClientConfig>, String> {
        let now = stamp(&self.path)?;
        let mut cached = self.cached.lock().unwrap_or_else(|e| e.into_inner());
        if cached.0 != now {
            *cached = (now, tls_config(Some(&self.path))?);
        }
        Ok(cached.1.clone())
    }
}

/// The certificates of the PEM file at `path`, as trust roots; at least one.
/// Errors name the path.
pub fn roots(path: &std::path::Path) -> Result<rustls::RootCertStore, String> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::CertificateDer;
    let mut roots = rustls::RootCertStore::empty();
    let certs = CertificateDer::pem_file_iter(path).map_err(|e| format!("{}: {e}", path.display()))?;
    for cert in certs {
        let cert = cert.map_err(|e| format!("{}: {e}", path.display()))?;
        roots.add(cert).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    if roots.is_empty() {
        return Err(format!("{}: no certificate", path.display()));
    }
    Ok(roots)
}

/// An `http(s)://host[:port][/path]` URL the daemon connects to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Origin {
    /// `https` (true) or `http` (false).
    pub tls: bool,
    /// The host name (lowercase) or address, IPv6 without brackets.
    pub host: String,
    /// The port, the scheme's default when the URL names none.
    pub port: u16,
    /// Without a trailing `/`; empty for the root.
    pub path: String,
}

impl Origin {
    /// Parses an `http(s)://host[:port][/path]` URL; the error says what is wrong.
    pub fn parse(url: &str) -> Result<Origin, String> {
        let endpoint = super::Endpoint::parse(url)?;
        let tls = url.to_ascii_lowercase().starts_with("https://");
        let rest = &url[if tls { 8 } else { 7 }..];
        let path = rest.find('/').map(|i| rest[i..].trim_end_matches('/').to_string()).unwrap_or_default();
        Ok(Origin { tls, host: endpoint.host, port: endpoint.port, path })
    }

    /// `host[:port]` for the Host header (no port when it is the scheme's).
    pub fn authority(&self) -> String {
        let default = if self.tls { 443 } else { 80 };
        let host = if self.host.contains(':') { format!("[{}]", self.host) } else { self.host.clone() };
        if self.port == default {
            host
        } else {
            format!("{host}:{}", self.port)
        }
    }

    /// Plain HTTP to a host that is not on loopback: what a secret must
    /// never travel over.
    pub fn is_clear_beyond_loopback(&self) -> bool {
        !self.tls && !is_loopback(&self.host)
    }
}

/// Parses a URL a secret is sent to (a credential gateway's upstream, a
/// model endpoint): `https://`, or plain `http://` only to loopback.
pub fn secret_origin(url: &str) -> Result<Origin, String> {
    let origin = Origin::parse(url)?;
    if origin.is_clear_beyond_loopback() {
        return Err(format!(
            "{url:?}: a plain http upstream must be on loopback; anywhere else the key would cross the network in \
             clear (use https)"
        ));
    }
    Ok(origin)
}

/// Whether `host` is a loopback name or address.
pub fn is_loopback(host: &str) -> bool {
    host == "localhost" || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.to_canonical().is_loopback())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A CA file is read again once it changed, not before; one that can
    /// no longer be used (no certificate, gone) is an error, never the
    /// settings of before (a revoked CA stays revoked).
    #[test]
    fn a_changed_ca_file_is_read_again_and_a_broken_one_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.pem");
        let pem = |name: &str| rcgen::generate_simple_self_signed(vec![name.into()]).unwrap().cert.pem();
        let (a, b) = (pem("a"), pem("b"));
        std::fs::write(&ca, &a).unwrap();
        let source = TlsSource::new(Some(&ca)).unwrap();
        let first = source.config().unwrap();
        assert!(Arc::ptr_eq(&first, &source.config().unwrap()), "read again though unchanged");
        std::fs::write(&ca, format!("{a}{b}")).unwrap();
        let rotated = source.config().unwrap();
        assert!(!Arc::ptr_eq(&first, &rotated), "the rotated file was not read again");
        std::fs::write(&ca, "no certificate here\n").unwrap();
        assert!(source.config().unwrap_err().contains("no certificate"));
        std::fs::remove_file(&ca).unwrap();
        assert!(source.config().is_err(), "a removed CA file kept its settings");
        assert!(TlsSource::new(Some(&ca)).is_err());
    }
}
