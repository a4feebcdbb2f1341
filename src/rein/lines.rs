//! Reading a harness stream line by line without trusting it: a line is
//! capped in length, and the lines kept per stream are capped in bytes.

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

/// Whole lines kept from one stream, up to a cap; the rest is counted.
///
/// Never a part of a line: the text is scrubbed of credential values
/// later, and a value cut in two would keep a piece no pattern matches.
#[derive(Debug, Default)]
pub struct CappedBuffer {
    pub text: String,
    pub cap: usize,
    pub dropped: u64,
    /// A line did not fit: what follows it is dropped too, so the text is
    /// the stream's start with no gap at the cap (a line past
    /// [`MAX_LINE`] alone is dropped where it stood, and `dropped` counts
    /// it).
    full: bool,
}

impl CappedBuffer {
    pub fn new(cap: usize) -> Self {
        CappedBuffer { text: String::new(), cap, dropped: 0, full: false }
    }

    /// Appends a line and its newline if the cap leaves room for them;
    /// else counts them as dropped, with every later line. A line cut at
    /// [`MAX_LINE`] (`already_dropped` bytes past it) is dropped whole too.
    pub fn push_line(&mut self, line: &[u8], already_dropped: u64) {
        let text = String::from_utf8_lossy(line);
        let needed = text.len() + 1;
        self.full |= needed > self.cap.saturating_sub(self.text.len());
        if self.full || already_dropped > 0 {
            self.dropped += needed as u64 + already_dropped;
        } else {
            self.text.push_str(&text);
            self.text.push('\n');
        }
    }
}

/// How a harness's stdout is read once the harness has exited.
///
/// What it wrote before then and was not received yet is owed: every line
/// that ends within the bytes the reader had taken or the pipe held at the
/// exit (see `command::StdoutLines`). Those lines are read without a time
/// bound, however long a busy host takes to schedule the reader or to
/// store and publish what each says. What comes after them is from a
/// process the harness left behind, and reading stops at the first of:
/// - no line came for `quiet` (it keeps the pipe open and writes nothing);
/// - the reads after the owed lines waited `max_wait` in all (it writes
///   now and then);
/// - more than `leftover_max` bytes came after them (it writes fast).
///
/// Offsets count the stream's bytes from its start.
#[derive(Debug)]
pub struct ExitDrain {
    leftover_max: u64,
    quiet: Duration,
    max_wait: Duration,
    waited: Duration,
}

/// How the next read after the exit may wait.
#[derive(Debug, PartialEq)]
pub enum Wait {
    /// For an owed line: as long as it takes (looking again now and then
    /// at what is owed, which the reader's progress can lower).
    Owed,
    /// A leftover's: at most this long.
    AtMost(Duration),
    /// Reading is over.
    Stop,
}

impl ExitDrain {
    pub fn new(leftover_max: u64, quiet: Duration, max_wait: Duration) -> ExitDrain {
        ExitDrain { leftover_max, quiet, max_wait, waited: Duration::ZERO }
    }

    /// With the lines received up to offset `received` and those owed up
    /// to offset `owed`.
    pub fn next_wait(&self, received: u64, owed: u64) -> Wait {
        if received < owed {
            return Wait::Owed;
        }
        if received - owed > self.leftover_max {
            return Wait::Stop;
        }
        match self.max_wait.saturating_sub(self.waited) {
            left if left.is_zero() => Wait::Stop,
            left => Wait::AtMost(left.min(self.quiet)),
        }
    }

    /// A read for a leftover's line that waited `waited`.
    pub fn waited(&mut self, waited: Duration) {
        self.waited += waited;
    }
}

/// The bytes a line from [`LineReader::next_line`] took from its stream:
/// the line, what was dropped from it, and its newline.
pub fn line_bytes(line: &[u8], dropped: u64) -> u64 {
    line.len() as u64 + dropped + 1
}

/// What a [`Counted`] reader has read, as offsets from the stream's start.
#[derive(Debug)]
pub struct ReadCount {
    /// Bytes read.
    pub taken: AtomicU64,
    /// Just past the last newline read, not counting newlines past `mark`.
    pub lines_end: AtomicU64,
    /// See `lines_end`; none until it is set.
    pub mark: AtomicU64,
}

impl Default for ReadCount {
    fn default() -> Self {
        ReadCount { taken: AtomicU64::new(0), lines_end: AtomicU64::new(0), mark: AtomicU64::new(u64::MAX) }
    }
}

/// A reader that counts the bytes read through it, and where its last
/// line ends.
pub struct Counted<R> {
    inner: R,
    count: Arc<ReadCount>,
}

impl<R> Counted<R> {
    pub fn new(inner: R, count: Arc<ReadCount>) -> Self {
        Counted { inner, count }
    }
}

impl<R: AsyncRead + Unpin> AsyncRead for Counted<R> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = polled {
            let read = &buf.filled()[before..];
            let start = self.count.taken.fetch_add(read.len() as u64, Ordering::SeqCst);
            let mark = self.count.mark.load(Ordering::SeqCst);
            let within = usize::try_from(mark.saturating_sub(start)).unwrap_or(usize::MAX).min(read.len());
            if let Some(at) = read[..within].iter().rposition(|b| *b == b'\n') {
                self.count.lines_end.fetch_max(start + at as u64 + 1, Ordering::SeqCst);
            }
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
    fn owed_lines_are_read_without_a_timeout_then_a_leftover_is_bounded() {
        let mut drain = ExitDrain::new(100, 500 * MS, 10_000 * MS);
        assert_eq!(drain.next_wait(0, 1000), Wait::Owed);
        assert_eq!(drain.next_wait(999, 1000), Wait::Owed);
        assert_eq!(drain.next_wait(1000, 1000), Wait::AtMost(500 * MS));
        // A leftover writing now and then: 10 s of waiting in all.
        for _ in 0..19 {
            drain.waited(490 * MS);
        }
        assert_eq!(drain.next_wait(1019, 1000), Wait::AtMost(500 * MS), "9,310 ms waited");
        drain.waited(490 * MS);
        assert_eq!(drain.next_wait(1020, 1000), Wait::AtMost(200 * MS), "9,800 ms waited");
        drain.waited(200 * MS);
        assert_eq!(drain.next_wait(1021, 1000), Wait::Stop, "10 s waited in all");
    }

    #[test]
    fn a_leftover_writing_fast_is_read_up_to_its_bound() {
        let drain = ExitDrain::new(100, 500 * MS, 10_000 * MS);
        assert_eq!(drain.next_wait(1100, 1000), Wait::AtMost(500 * MS), "exactly the bound");
        assert_eq!(drain.next_wait(1101, 1000), Wait::Stop, "one byte more");
    }

    /// Where the lines end, as read in chunks of 4 bytes: not past the
    /// mark, once it is set, and never back.
    #[tokio::test]
    async fn a_counted_reader_knows_where_its_last_line_ends() {
        use tokio::io::AsyncReadExt;
        let count = Arc::new(ReadCount::default());
        let data = b"ab\ncdefg\nhij\nk".to_vec();
        let mut reader = Counted::new(&data[..], count.clone());
        let mut chunk = [0u8; 4];
        let mut ends = Vec::new();
        loop {
            let n = reader.read(&mut chunk).await.unwrap();
            if n == 0 {
                break;
            }
            let taken = count.taken.load(Ordering::SeqCst);
            if taken == 8 {
                // Marked at 12: the line that ends at 13 is past it.
                count.mark.store(12, Ordering::SeqCst);
            }
            ends.push((taken, count.lines_end.load(Ordering::SeqCst)));
        }
        assert_eq!(ends, [(4, 3), (8, 3), (12, 9), (14, 9)]);
    }

    #[test]
    fn a_line_counts_its_newline_and_what_was_dropped() {
        assert_eq!(line_bytes(b"step 1", 0), 7);
        assert_eq!(line_bytes(b"", 0), 1);
        assert_eq!(line_bytes(&[b'x'; 10], 5), 16);
    }

    #[tokio::test]
    async fn a_counted_reader_counts_every_byte_read_through_it() {
        let count = Arc::new(ReadCount::default());
        let data = b"one\ntwo\nthree".to_vec();
        let mut reader = LineReader::new(Counted::new(&data[..], count.clone()));
        let mut lines = 0;
        while let Some((line, dropped)) = reader.next_line().await.unwrap() {
            lines += line_bytes(&line, dropped);
        }
        assert_eq!(count.taken.load(Ordering::SeqCst), 13);
        assert_eq!(count.lines_end.load(Ordering::SeqCst), 8);
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
    fn capped_buffer_keeps_whole_lines_and_counts_what_it_drops() {
        let mut buf = CappedBuffer::new(10);
        buf.push_line(b"12345", 0);
        buf.push_line(b"abcdefgh", 0);
        // It would fit, but after a gap.
        buf.push_line(b"z", 0);
        assert_eq!(buf.text, "12345\n", "no part of a line");
        assert_eq!(buf.dropped, 9 + 2);
        let mut buf = CappedBuffer::new(100);
        buf.push_line(b"cut at MAX_LINE", 7);
        buf.push_line(b"next", 0);
        assert_eq!(buf.text, "next\n", "a line the reader cut is dropped whole");
        assert_eq!(buf.dropped, 16 + 7);
        let mut buf = CappedBuffer::new(6);
        buf.push_line(b"12345", 0);
        assert_eq!((buf.text.as_str(), buf.dropped), ("12345\n", 0), "exactly the cap");
    }
}
