//! The unix socket: binding it, and one HTTP/2 leniency its clients need.
//!
//! Many gRPC clients send the socket's *path* as `:authority` on a unix
//! socket — grpcurl `-unix`, grpc-java, grpc-python ≥ 1.57 (percent-encoded).
//! h2 resets such a stream with `PROTOCOL_ERROR` before corral sees the call
//! (hyperium/h2#487). grpc-go's and containerd's servers ignore the
//! authority on a unix socket, and so does corral: each connection passes
//! through a relay that reads the client's frames with h2's own codec (its
//! HPACK decoder and frame limits), drops an `:authority` that is not a URI
//! authority (a socket has no host), and writes the frames on to the server.
//! The server writes its bytes to the client's socket itself; the peer's
//! credentials travel with the connection, so `[auth]` sees the same uid.
//!
//! The relay re-encodes what it reads, so two things it cannot carry
//! faithfully end the connection instead (with a log line): a padded DATA
//! frame (its padding counts against flow control) and a frame the codec
//! refuses. No mainstream gRPC client pads.

use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use h2::frame::{Frame, Headers};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, DuplexStream, ReadBuf};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{UnixListener, UnixStream};
use tonic::transport::server::{Connected, UdsConnectInfo};

use super::ServeError;

/// The largest header list the relay decodes: the server's (hyper's default).
const MAX_HEADER_LIST_BYTES: usize = 16 << 10;

/// The HTTP/2 client connection preface (RFC 9113 §3.4).
const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Bytes of the client's frames buffered between the relay and the server.
const RELAY_BUFFER: usize = 256 * 1024;

/// Binds the unix socket (replacing a stale one), mode 0660, owned by
/// `group` when one is given.
pub(super) fn bind(path: &Path, group: Option<u32>) -> Result<(UnixListener, PathBuf), ServeError> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    let err = |source: io::Error| ServeError::Socket { path: path.display().to_string(), source };
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            return Err(err(io::Error::other("exists and is not a socket")));
        }
        std::fs::remove_file(path).map_err(err)?;
    }
    let listener = UnixListener::bind(path).map_err(err)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660)).map_err(err)?;
    if let Some(gid) = group {
        std::os::unix::fs::chown(path, None, Some(gid)).map_err(err)?;
    }
    Ok((listener, path.to_path_buf()))
}

/// The socket's accepted connections, each already behind its relay.
pub(super) fn incoming(listener: UnixListener) -> impl futures_core::Stream<Item = io::Result<Relayed>> {
    tokio_stream::wrappers::UnixListenerStream::new(listener).map(|accepted| accepted.map(relay))
}

/// The server's end of one unix connection: it reads the client's frames
/// from the relay and writes its own bytes straight to the client's socket
/// (they need no correction, and a stream of events to many watchers is
/// nearly all of a connection's bytes).
pub(super) struct Relayed {
    /// The relay's output: the client's frames, corrected.
    from_relay: DuplexStream,
    to_client: OwnedWriteHalf,
    peer: UdsConnectInfo,
    /// The relay's task, which reads the client: ended with the connection.
    relay: tokio::task::AbortHandle,
}

impl Connected for Relayed {
    type ConnectInfo = UdsConnectInfo;
    fn connect_info(&self) -> UdsConnectInfo {
        self.peer.clone()
    }
}

impl AsyncRead for Relayed {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.from_relay).poll_read(cx, buf)
    }
}

impl AsyncWrite for Relayed {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.to_client).poll_write(cx, buf)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.to_client).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.to_client.is_write_vectored()
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.to_client).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.to_client).poll_shutdown(cx)
    }
}

impl Drop for Relayed {
    fn drop(&mut self) {
        self.relay.abort();
    }
}

fn relay(client: UnixStream) -> Relayed {
    let peer = client.connect_info();
    let (client_read, to_client) = client.into_split();
    let (from_relay, relay_end) = tokio::io::duplex(RELAY_BUFFER);
    let relay = tokio::spawn(forward(client_read, relay_end)).abort_handle();
    Relayed { from_relay, to_client, peer, relay }
}

/// Writes the client's frames, corrected, to the server until the client
/// closes or sends what cannot be relayed (the server then reads the end
/// of its input and closes the connection).
async fn forward(mut client: OwnedReadHalf, mut server: DuplexStream) {
    let mut preface = [0u8; PREFACE.len()];
    if client.read_exact(&mut preface).await.is_err() || server.write_all(&preface).await.is_err() {
        return;
    }
    if &preface != PREFACE {
        // Not HTTP/2 with prior knowledge: the server says so itself.
        let _ = tokio::io::copy(&mut client, &mut server).await;
        let _ = server.shutdown().await;
        return;
    }
    let mut codec: h2::Codec<_, Bytes> = h2::Codec::new(tokio::io::join(client, server));
    // The server's own limit (hyper's 16 KiB), before anything is decoded:
    // h2's codec would otherwise buffer a header block of up to 16 MiB from
    // a caller not yet authenticated.
    codec.set_max_recv_header_list_size(MAX_HEADER_LIST_BYTES);
    while let Some(frame) = codec.next().await {
        let frame = match frame {
            Ok(frame) => frame,
            Err(e) => {
                tracing::debug!(error = %e, "unix socket: a frame the relay cannot read; closing the connection");
                break;
            }
        };
        let Some(frame) = corrected(frame) else {
            tracing::warn!(
                "unix socket: a frame the relay cannot pass on whole (a padded DATA frame, or a header list over \
                 16 KiB); closing the connection"
            );
            break;
        };
        if codec.send(frame).await.is_err() {
            break;
        }
    }
    let _ = codec.get_mut().shutdown().await;
}

/// The frame to send on: HEADERS rebuilt without an `:authority` that is
/// not one (and without padding or priority, which h2's encoder would
/// otherwise misframe); `None` for a padded DATA frame, and for HEADERS
/// whose list was over [`MAX_HEADER_LIST_BYTES`] (h2 dropped the fields
/// past it: sent on, they would be another request).
fn corrected(frame: Frame) -> Option<Frame> {
    match frame {
        Frame::Headers(headers) if headers.is_over_size() => None,
        Frame::Headers(headers) => {
            let id = headers.stream_id();
            let end_stream = headers.is_end_stream();
            let (mut pseudo, fields) = headers.into_parts();
            if pseudo.authority.as_ref().is_some_and(|a| http::uri::Authority::try_from(&a[..]).is_err()) {
                pseudo.authority = None;
            }
            let mut rebuilt = Headers::new(id, pseudo, fields);
            if end_stream {
                rebuilt.set_end_stream();
            }
            Some(Frame::Headers(rebuilt))
        }
        Frame::Data(data) if data.is_padded() => None,
        other => Some(other),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The server's bytes go to the client's socket as they are written,
    /// the client's frames come through the relay, and once the server lets
    /// go of the connection the socket is closed: the relay's task, which
    /// reads the client, does not outlive it.
    #[tokio::test]
    async fn the_server_writes_to_the_client_and_the_relay_ends_with_the_connection() {
        let (client, accepted) = UnixStream::pair().unwrap();
        let mut server = relay(accepted);
        let (mut client_read, mut client_write) = client.into_split();

        server.write_all(b"from the server").await.unwrap();
        server.flush().await.unwrap();
        let mut got = [0u8; 15];
        client_read.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"from the server");

        let mut wire = PREFACE.to_vec();
        wire.extend(frame(0x4, 0, 0, &[])); // an empty SETTINGS frame
        client_write.write_all(&wire).await.unwrap();
        let mut relayed = vec![0u8; wire.len()];
        server.read_exact(&mut relayed).await.unwrap();
        assert_eq!(relayed, wire);

        drop(server);
        let mut rest = Vec::new();
        client_read.read_to_end(&mut rest).await.unwrap();
        assert!(rest.is_empty(), "{rest:?}");
        // The socket's other end is closed, not only shut for writing (the
        // client sends nothing more that would end the relay by itself).
        let fd = std::os::fd::AsRawFd::as_raw_fd(client_write.as_ref());
        let hung_up = || {
            let mut poll = libc::pollfd { fd, events: libc::POLLOUT, revents: 0 };
            // SAFETY: one valid pollfd, no timeout.
            unsafe { libc::poll(&mut poll, 1, 0) };
            poll.revents & libc::POLLHUP != 0
        };
        let closed = tokio::time::timeout(std::time::Duration::from_secs(5), async {
            while !hung_up() {
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            }
        })
        .await;
        assert!(closed.is_ok(), "the relay still reads the client after the server let go of the connection");
    }

    /// Frames read from raw bytes the way the relay reads a client's.
    async fn frames(wire: &[u8]) -> Vec<Frame> {
        let (mut near, far) = tokio::io::duplex(4096);
        near.write_all(wire).await.unwrap();
        drop(near);
        let mut codec: h2::Codec<_, Bytes> = h2::Codec::new(far);
        let mut out = Vec::new();
        while let Some(Ok(frame)) = codec.next().await {
            out.push(frame);
        }
        out
    }

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let len = payload.len() as u32;
        let mut wire = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
        wire.extend_from_slice(&stream.to_be_bytes());
        wire.extend_from_slice(payload);
        wire
    }

    /// `:method POST`, `:scheme http`, `:path /x` and `:authority AUTHORITY`,
    /// as literals without indexing (RFC 7541 §6.2.2).
    fn request_block(authority: &str) -> Vec<u8> {
        let mut block = vec![0x83, 0x86, 0x04, 2, b'/', b'x', 0x01, authority.len() as u8];
        block.extend_from_slice(authority.as_bytes());
        block
    }

    fn authority_of(frame: Frame) -> Option<String> {
        let Frame::Headers(headers) = frame else { panic!("not HEADERS: {frame:?}") };
        headers.into_parts().0.authority.map(|a| a.to_string())
    }

    /// HPACK's integer with a 7-bit prefix (RFC 7541 §5.1), the prefix's
    /// other bits zero.
    fn hpack_length(mut n: usize) -> Vec<u8> {
        if n < 127 {
            return vec![n as u8];
        }
        let mut out = vec![0x7f];
        n -= 127;
        while n >= 128 {
            out.push((n % 128) as u8 | 0x80);
            n /= 128;
        }
        out.push(n as u8);
        out
    }

    /// A header list past the server's 16 KiB (one 24,000-byte field, in a
    /// HEADERS and a CONTINUATION frame) is neither buffered up to h2's 16
    /// MiB nor sent on: the relay closes the connection.
    #[tokio::test]
    async fn a_header_list_over_the_servers_limit_is_not_relayed() {
        let (client, accepted) = UnixStream::pair().unwrap();
        let mut server = relay(accepted);
        let (_client_read, mut client_write) = client.into_split();
        let mut block = request_block("localhost");
        block.extend([0x00, 5]);
        block.extend_from_slice(b"x-pad");
        block.extend(hpack_length(24_000));
        block.extend(std::iter::repeat_n(b'a', 24_000));
        let (first, rest) = block.split_at(12_000);
        let mut wire = PREFACE.to_vec();
        wire.extend(frame(0x1, 0x1, 1, first));
        wire.extend(frame(0x9, 0x4, 1, rest));
        client_write.write_all(&wire).await.unwrap();
        let mut relayed = Vec::new();
        let read = tokio::time::timeout(std::time::Duration::from_secs(5), server.read_to_end(&mut relayed)).await;
        assert!(read.is_ok(), "the relay passed the header list on and kept the connection: {} bytes", relayed.len());
        assert_eq!(relayed, PREFACE.to_vec(), "only the preface reached the server");
    }

    #[tokio::test]
    async fn a_socket_path_as_authority_is_dropped_and_a_host_is_kept() {
        let mut wire = frame(0x1, 0x4 | 0x1, 1, &request_block("/run/corral/corral.sock"));
        wire.extend(frame(0x1, 0x4 | 0x1, 3, &request_block("%2Frun%2Fcorral.sock")));
        wire.extend(frame(0x1, 0x4 | 0x1, 5, &request_block("localhost")));
        let read = frames(&wire).await;
        assert_eq!(read.len(), 3);
        let authorities: Vec<_> = read.into_iter().map(|f| authority_of(corrected(f).unwrap())).collect();
        // h2's rule (`http::uri::Authority`) decides: a path, raw or
        // percent-encoded (grpc-python), is no authority; a host is kept.
        assert_eq!(authorities, vec![None, None, Some("localhost".to_string())]);
    }

    #[tokio::test]
    async fn padded_and_prioritised_headers_are_rebuilt_and_keep_end_stream() {
        // PADDED (0x8) | PRIORITY (0x20) | END_HEADERS | END_STREAM: pad
        // length 3, a 5-byte stream dependency, the block, 3 zero bytes.
        let mut payload = vec![3, 0, 0, 0, 0, 16];
        payload.extend(request_block("localhost"));
        payload.extend([0, 0, 0]);
        let read = frames(&frame(0x1, 0x8 | 0x20 | 0x4 | 0x1, 1, &payload)).await;
        let Some(Frame::Headers(rebuilt)) = read.into_iter().next().and_then(corrected) else { panic!("no HEADERS") };
        assert!(rebuilt.is_end_stream() && rebuilt.is_end_headers());
        assert!(!format!("{rebuilt:?}").contains("stream_dep"), "{rebuilt:?}");
    }

    #[tokio::test]
    async fn a_padded_data_frame_is_not_relayed_and_a_plain_one_is() {
        let mut wire = frame(0x0, 0x8, 1, &[2, b'h', b'i', 0, 0]);
        wire.extend(frame(0x0, 0x1, 1, b"hi"));
        let read = frames(&wire).await;
        assert_eq!(read.len(), 2);
        let mut read = read.into_iter();
        assert!(corrected(read.next().unwrap()).is_none());
        let Some(Frame::Data(plain)) = corrected(read.next().unwrap()) else { panic!("no DATA") };
        assert_eq!(plain.payload().as_ref(), b"hi");
    }
}
