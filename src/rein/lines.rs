//! Reading a harness stream line by line without trusting it: a line is
//! capped in length, and bytes kept per stream are capped in total.

use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};

/// The longest line parsed as a protocol message; longer ones are plain
/// output (kept within the stream cap).
pub const MAX_LINE: usize = 1 << 20;

pub struct LineReader<R> {
    inner: BufReader<R>,
}

impl<R: AsyncRead + Unpin> LineReader<R> {
    pub fn new(inner: R) -> Self {
        LineReader { inner: BufReader::with_capacity(64 * 1024, inner) }
    }

    /// The next line without its newline, and how many bytes past
    /// [`MAX_LINE`] were dropped from it; `None` at end of stream.
    pub async fn next_line(&mut self) -> std::io::Result<Option<(Vec<u8>, u64)>> {
        let mut line = Vec::new();
        let mut dropped = 0u64;
        loop {
            let buf = self.inner.fill_buf().await?;
            if buf.is_empty() {
                return Ok(if line.is_empty() && dropped == 0 { None } else { Some((line, dropped)) });
            }
            let (chunk, done) = match buf.iter().position(|b| *b == b'\n') {
                Some(at) => (&buf[..at], Some(at + 1)),
                None => (buf, None),
            };
            let room = MAX_LINE.saturating_sub(line.len());
            let keep = chunk.len().min(room);
            line.extend_from_slice(&chunk[..keep]);
            dropped += (chunk.len() - keep) as u64;
            let consumed = done.unwrap_or(buf.len());
            self.inner.consume(consumed);
            if done.is_some() {
                return Ok(Some((line, dropped)));
            }
        }
    }
}

/// Bytes kept from one stream, up to a cap; the rest is counted.
#[derive(Debug, Default)]
pub struct CappedBuffer {
    pub text: String,
    pub cap: usize,
    pub dropped: u64,
}

impl CappedBuffer {
    pub fn new(cap: usize) -> Self {
        CappedBuffer { text: String::new(), cap, dropped: 0 }
    }

    /// Appends a line (and its newline) as far as the cap allows.
    pub fn push_line(&mut self, line: &[u8], already_dropped: u64) {
        let text = String::from_utf8_lossy(line);
        let needed = text.len() + 1;
        let room = self.cap.saturating_sub(self.text.len());
        if needed <= room {
            self.text.push_str(&text);
            self.text.push('\n');
        } else {
            let mut cut = room.min(text.len());
            while !text.is_char_boundary(cut) {
                cut -= 1;
            }
            self.text.push_str(&text[..cut]);
            self.dropped += (needed - cut) as u64;
        }
        self.dropped += already_dropped;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn splits_lines_and_caps_length() {
        let mut data = b"one\ntwo\n".to_vec();
        data.extend(std::iter::repeat_n(b'x', MAX_LINE + 10));
        data.extend(b"\nlast");
        let mut reader = LineReader::new(&data[..]);
        assert_eq!(reader.next_line().await.unwrap(), Some((b"one".to_vec(), 0)));
        assert_eq!(reader.next_line().await.unwrap(), Some((b"two".to_vec(), 0)));
        let (long, dropped) = reader.next_line().await.unwrap().unwrap();
        assert_eq!((long.len(), dropped), (MAX_LINE, 10));
        assert_eq!(reader.next_line().await.unwrap(), Some((b"last".to_vec(), 0)));
        assert_eq!(reader.next_line().await.unwrap(), None);
    }

    #[test]
    fn capped_buffer_counts_what_it_drops() {
        let mut buf = CappedBuffer::new(10);
        buf.push_line(b"12345", 0);
        buf.push_line(b"abcdefgh", 0);
        assert_eq!(buf.text, "12345\nabcd");
        assert_eq!(buf.dropped, 5);
    }
}
