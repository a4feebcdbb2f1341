//! Percentiles of a few hundred samples (exact), and a lock-free histogram
//! for the hundred million delivery delays of a fanout run.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::Serialize;

/// p50/p90/p99 (nearest rank) of a sample set, in milliseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Percentiles {
    /// Samples.
    pub count: usize,
    /// The median, in ms.
    pub p50_ms: f64,
    /// The 90th percentile, in ms.
    pub p90_ms: f64,
    /// The 99th percentile, in ms.
    pub p99_ms: f64,
    /// The largest sample, in ms.
    pub max_ms: f64,
    /// The mean, in ms.
    pub mean_ms: f64,
}

impl Percentiles {
    /// The percentiles of `samples` (in ms); all zero when there are none.
    pub fn of_ms(samples: &[f64]) -> Percentiles {
        if samples.is_empty() {
            return Percentiles::default();
        }
        let mut sorted = samples.to_vec();
        sorted.sort_by(f64::total_cmp);
        Percentiles {
            count: sorted.len(),
            p50_ms: nearest_rank(&sorted, 0.50),
            p90_ms: nearest_rank(&sorted, 0.90),
            p99_ms: nearest_rank(&sorted, 0.99),
            max_ms: sorted[sorted.len() - 1],
            mean_ms: sorted.iter().sum::<f64>() / sorted.len() as f64,
        }
    }
}

/// The smallest sample with at least `q` of the samples at or below it.
pub fn nearest_rank(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// The median of unsorted samples.
pub fn median(samples: &[f64]) -> f64 {
    let mut sorted = samples.to_vec();
    sorted.sort_by(f64::total_cmp);
    nearest_rank(&sorted, 0.5)
}

/// Sub-buckets per power of two: values are kept within 1/32 (~3%).
const SUB_BITS: u32 = 5;
const SUB: u64 = 1 << SUB_BITS;
/// Values below this are counted exactly.
const EXACT: u64 = 2 * SUB;
const BUCKETS: usize = (EXACT + (64 - SUB_BITS as u64 - 1) * SUB) as usize;

/// A log-linear histogram of microsecond values that many tasks record
/// into at once (relaxed atomic adds: no lock, no per-watcher memory).
pub struct Histogram {
    counts: Box<[AtomicU64]>,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram { counts: (0..BUCKETS).map(|_| AtomicU64::new(0)).collect() }
    }
}

impl Histogram {
    pub fn record(&self, micros: u64) {
        self.counts[bucket(micros)].fetch_add(1, Ordering::Relaxed);
    }

    pub fn count(&self) -> u64 {
        self.counts.iter().map(|c| c.load(Ordering::Relaxed)).sum()
    }

    /// The value (upper bound of its bucket, in µs) below which `q` of the
    /// recorded values fall; 0 when empty.
    pub fn quantile(&self, q: f64) -> u64 {
        let total = self.count();
        if total == 0 {
            return 0;
        }
        let rank = ((q * total as f64).ceil() as u64).clamp(1, total);
        let mut seen = 0;
        for (i, c) in self.counts.iter().enumerate() {
            seen += c.load(Ordering::Relaxed);
            if seen >= rank {
                return upper_bound(i);
            }
        }
        upper_bound(BUCKETS - 1)
    }
}

fn bucket(v: u64) -> usize {
    if v < EXACT {
        return v as usize;
    }
    let exp = 63 - v.leading_zeros(); // >= SUB_BITS + 1
    let sub = (v >> (exp - SUB_BITS)) & (SUB - 1);
    (EXACT + (exp - SUB_BITS - 1) as u64 * SUB + sub) as usize
}

fn upper_bound(index: usize) -> u64 {
    let i = index as u64;
    if i < EXACT {
        return i;
    }
    let exp = (i - EXACT) / SUB + SUB_BITS as u64 + 1;
    let sub = (i - EXACT) % SUB;
    let low = (1u64 << exp) + (sub << (exp - SUB_BITS as u64));
    low.saturating_add((1u64 << (exp - SUB_BITS as u64)) - 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let samples: Vec<f64> = (1..=100).map(f64::from).collect();
        let p = Percentiles::of_ms(&samples);
        assert_eq!((p.p50_ms, p.p90_ms, p.p99_ms, p.max_ms), (50.0, 90.0, 99.0, 100.0));
        assert_eq!(Percentiles::of_ms(&[7.0]).p99_ms, 7.0);
        assert_eq!(Percentiles::of_ms(&[]).count, 0);
    }

    #[test]
    fn histogram_buckets_are_monotonic_and_tight() {
        let mut last = 0;
        for v in (0..2_000_000u64).step_by(997).chain([u64::MAX / 2, u64::MAX]) {
            let b = bucket(v);
            assert!(b >= last, "bucket({v}) went backwards");
            last = b;
            let hi = upper_bound(b);
            assert!(hi >= v, "upper bound {hi} below {v}");
            assert!(hi - v <= v / 16 + 1, "bucket of {v} too wide: {hi}");
        }
    }

    #[test]
    fn histogram_quantiles() {
        let h = Histogram::default();
        for v in 1..=1000 {
            h.record(v);
        }
        assert_eq!(h.count(), 1000);
        let p99 = h.quantile(0.99);
        assert!((990..=1023).contains(&p99), "p99 {p99}");
        assert_eq!(h.quantile(0.01), 10);
    }
}
