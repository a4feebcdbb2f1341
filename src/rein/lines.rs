//! Reading a harness stream line by line without trusting it: a line is
//! capped in length, and bytes kept per stream are capped in total.

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader, ReadBuf};

/// The longest line parsed as a protocol message; longer ones are plain
/// output (kept within the stream cap).
pub const MAX_LINE: usize = 1 << 20;

/// What a [`LineReader`] reads ahead of the line it returns.
pub const READ_BUFFER: usize = 64 * 1024;

pub struct LineReader<R> {
    inner: BufReader<R>,
}

impl<R: AsyncRead + Unpin> LineReader<R> {
    pub fn new(inner: R) -> Self {
        LineReader { inner: BufReader::with_capacity(READ_BUFFER, inner) }
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

/// How a harness's stdout is read once the harness has exited.
///
/// What it wrote before then and was not received yet is `owed`: the bytes
/// still in the pipe and those the reader took but has not handed on as
/// lines (see `command::StdoutLines::unreceived`). All of that is read,
/// without a timeout, however long a busy host takes to schedule the
/// reader or to store and publish what each line says. After it, what
/// comes is from a process the harness left behind, and reading stops at
/// the first of:
/// - no line came for `quiet` (it keeps the pipe open and writes nothing);
/// - the reads after `owed` waited `max_wait` in all (it writes now and
///   then);
/// - more than `leftover_max` bytes came after `owed` (it writes fast).
#[derive(Debug)]
pub struct ExitDrain {
    owed: u64,
    leftover_max: u64,
    quiet: Duration,
    max_wait: Duration,
    got: u64,
    waited: Duration,
}

/// How the next read after the exit may wait.
#[derive(Debug, PartialEq)]
pub enum Wait {
    /// The harness's own bytes: as long as the line takes.
    Owed,
    /// A leftover's: at most this long.
    AtMost(Duration),
    /// Reading is over.
    Stop,
}

impl ExitDrain {
    pub fn new(owed: u64, leftover_max: u64, quiet: Duration, max_wait: Duration) -> ExitDrain {
        ExitDrain { owed, leftover_max, quiet, max_wait, got: 0, waited: Duration::ZERO }
    }

    pub fn next_wait(&self) -> Wait {
        if self.got < self.owed {
            return Wait::Owed;
        }
        if self.got - self.owed > self.leftover_max {
            return Wait::Stop;
        }
        match self.max_wait.saturating_sub(self.waited) {
            left if left.is_zero() => Wait::Stop,
            left => Wait::AtMost(left.min(self.quiet)),
        }
    }

    /// A read that waited `waited` for a line of `bytes` (see
    /// [`line_bytes`]).
    pub fn read(&mut self, waited: Duration, bytes: u64) {
        if self.got >= self.owed {
            self.waited += waited;
        }
        self.got = self.got.saturating_add(bytes);
    }
}

/// The bytes a line from [`LineReader::next_line`] took from its stream:
/// the line, what was dropped from it, and its newline.
pub fn line_bytes(line: &[u8], dropped: u64) -> u64 {
    line.len() as u64 + dropped + 1
}

/// A reader that counts the bytes read through it.
pub struct Counted<R> {
    inner: R,
    count: Arc<AtomicU64>,
}

impl<R> Counted<R> {
    pub fn new(inner: R, count: Arc<AtomicU64>) -> Self {
        Counted { inner, count }
    }
}

impl<R: AsyncRead + Unpin> AsyncRead for Counted<R> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = polled {
            self.count.fetch_add((buf.filled().len() - before) as u64, Ordering::SeqCst);
        }
        polled
    }
}

/// The host's `pipe-max-size`: the largest pipe an unprivileged process
/// can ask for (the kernel's default, 1 MiB, if it cannot be read).
pub fn pipe_max_size() -> u64 {
    std::fs::read_to_string("/proc/sys/fs/pipe-max-size")
        .ok()
        .and_then(|text| text.trim().parse().ok())
        .unwrap_or(1 << 20)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn what_the_harness_left_is_read_without_a_timeout_then_a_leftover_is_bounded() {
        let mut drain = ExitDrain::new(1000, 100, 500 * MS, 10_000 * MS);
        assert_eq!(drain.next_wait(), Wait::Owed);
        // Its own bytes, however long each read waited (a starved reader).
        for _ in 0..9 {
            drain.read(60_000 * MS, 100);
        }
        assert_eq!(drain.next_wait(), Wait::Owed, "900 of 1,000 owed bytes");
        drain.read(60_000 * MS, 100);
        assert_eq!(drain.next_wait(), Wait::AtMost(500 * MS), "what it owed was read; its waits do not count");
        // A leftover writing now and then: 10 s of waiting in all.
        for _ in 0..19 {
            drain.read(490 * MS, 1);
        }
        assert_eq!(drain.next_wait(), Wait::AtMost(500 * MS), "9,310 ms waited");
        drain.read(490 * MS, 1);
        assert_eq!(drain.next_wait(), Wait::AtMost(200 * MS), "9,800 ms waited");
        drain.read(200 * MS, 1);
        assert_eq!(drain.next_wait(), Wait::Stop, "10 s waited in all");
    }

    #[test]
    fn a_leftover_writing_fast_is_read_up_to_its_bound() {
        let mut drain = ExitDrain::new(10, 100, 500 * MS, 10_000 * MS);
        drain.read(Duration::ZERO, 10);
        drain.read(Duration::ZERO, 100);
        assert_eq!(drain.next_wait(), Wait::AtMost(500 * MS), "exactly the bound");
        drain.read(Duration::ZERO, 1);
        assert_eq!(drain.next_wait(), Wait::Stop, "one byte more");
    }

    #[test]
    fn a_line_counts_its_newline_and_what_was_dropped() {
        assert_eq!(line_bytes(b"step 1", 0), 7);
        assert_eq!(line_bytes(b"", 0), 1);
        assert_eq!(line_bytes(&[b'x'; 10], 5), 16);
    }

    #[tokio::test]
    async fn a_counted_reader_counts_every_byte_read_through_it() {
        let count = Arc::new(AtomicU64::new(0));
        let data = b"one\ntwo\nthree".to_vec();
        let mut reader = LineReader::new(Counted::new(&data[..], count.clone()));
        let mut lines = 0;
        while let Some((line, dropped)) = reader.next_line().await.unwrap() {
            lines += line_bytes(&line, dropped);
        }
        assert_eq!(count.load(Ordering::SeqCst), 13);
        assert_eq!(lines, 14, "the last line has no newline");
    }

    #[test]
    fn the_pipe_max_size_is_the_hosts() {
        let host: u64 = std::fs::read_to_string("/proc/sys/fs/pipe-max-size").unwrap().trim().parse().unwrap();
        assert_eq!(pipe_max_size(), host);
    }

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
