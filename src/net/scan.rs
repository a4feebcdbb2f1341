//! The run's credential placeholders in what a sandbox sends through its
//! egress proxy: only the credential gateway may take them, so a request
//! head or a plain-text tunnel that carries one is refused.

/// Why a request or tunnel carrying a placeholder is refused.
pub(crate) const PLACEHOLDER_REFUSAL: &str =
    "it carries a credential placeholder of this run, which only corral's credential gateway takes";

/// The refusal of a request head (and what followed it) that carries one
/// of `forbidden`.
pub(crate) fn carries_forbidden(bytes: &[u8], forbidden: &[String]) -> Option<String> {
    let mut scanner = Scanner::new(forbidden);
    scanner.hit(bytes).then(|| PLACEHOLDER_REFUSAL.to_string())
}

/// Finds any of a few needles in a byte stream read in chunks, across
/// chunk boundaries.
pub struct Scanner {
    needles: Vec<Vec<u8>>,
    tail: Vec<u8>,
    keep: usize,
}

impl Scanner {
    /// A scanner for `needles` (empty ones are ignored).
    pub fn new(needles: &[String]) -> Scanner {
        let needles: Vec<Vec<u8>> = needles.iter().filter(|n| !n.is_empty()).map(|n| n.as_bytes().to_vec()).collect();
        let keep = needles.iter().map(Vec::len).max().unwrap_or(1).saturating_sub(1);
        Scanner { needles, tail: Vec::new(), keep }
    }

    /// Whether a needle ends in `chunk` (it may start in an earlier one).
    pub fn hit(&mut self, chunk: &[u8]) -> bool {
        if self.needles.is_empty() {
            return false;
        }
        self.tail.extend_from_slice(chunk);
        let found = self.needles.iter().any(|n| self.tail.windows(n.len()).any(|w| w == n.as_slice()));
        let cut = self.tail.len().saturating_sub(self.keep);
        self.tail.drain(..cut);
        found
    }
}
