//! The ranks' observed/predicted TTFT ratios as an ordered multiset, so the estimator's median
//! and minimum follow one rank's change in O(log ranks) instead of a pass over every rank (at
//! thousands of ranks that pass ran on every first token). Owns only the order statistics; what
//! a ratio is stays in the estimator ([`super`]).

use std::collections::BTreeMap;

/// A multiset of `u64` keys with its size.
#[derive(Debug, Clone, Default)]
struct Bag {
    counts: BTreeMap<u64, u32>,
    len: usize,
}

impl Bag {
    fn insert(&mut self, key: u64) {
        *self.counts.entry(key).or_insert(0) += 1;
        self.len += 1;
    }

    /// Removes one copy of `key`; false if it held none.
    fn remove(&mut self, key: u64) -> bool {
        let Some(count) = self.counts.get_mut(&key) else {
            return false;
        };
        *count -= 1;
        if *count == 0 {
            self.counts.remove(&key);
        }
        self.len -= 1;
        true
    }

    fn first(&self) -> Option<u64> {
        self.counts.keys().next().copied()
    }

    fn last(&self) -> Option<u64> {
        self.counts.keys().next_back().copied()
    }
}

/// `x`'s place in `f64::total_cmp` order as an unsigned key.
fn total_key(x: f64) -> u64 {
    let bits = x.to_bits();
    if bits >> 63 == 1 {
        !bits
    } else {
        bits | 1 << 63
    }
}

fn from_total_key(key: u64) -> f64 {
    if key >> 63 == 1 {
        f64::from_bits(key & !(1 << 63))
    } else {
        f64::from_bits(!key)
    }
}

/// Every rank's ratio. The positive finite ones (those the median is over) are split into the
/// lower half `low` (the first `n / 2` in order) and `high` (the rest), keyed by their bits,
/// which order positive finite floats as numbers: the median, the element at `n / 2`, is the
/// first of `high`. Other ratios (zero, infinite, negative) only count for the minimum; a NaN
/// makes the minimum NaN, as a fold over the ratios would.
#[derive(Debug, Clone, Default)]
pub(super) struct Ratios {
    low: Bag,
    high: Bag,
    other: Bag,
    nan: usize,
}

impl Ratios {
    pub fn insert(&mut self, ratio: f64) {
        if ratio.is_nan() {
            self.nan += 1;
        } else if ratio.is_finite() && ratio > 0.0 {
            let key = ratio.to_bits();
            if self.high.first().is_some_and(|first| key >= first) {
                self.high.insert(key);
            } else {
                self.low.insert(key);
            }
            self.rebalance();
        } else {
            self.other.insert(total_key(ratio));
        }
    }

    /// Removes one copy of a ratio inserted before (the same value, bit for bit).
    pub fn remove(&mut self, ratio: f64) {
        if ratio.is_nan() {
            self.nan = self.nan.saturating_sub(1);
        } else if ratio.is_finite() && ratio > 0.0 {
            let key = ratio.to_bits();
            let in_low = self.low.last().is_some_and(|last| key <= last);
            if !(in_low && self.low.remove(key)) {
                self.high.remove(key);
            }
            self.rebalance();
        } else {
            self.other.remove(total_key(ratio));
        }
    }

    fn rebalance(&mut self) {
        let half = (self.low.len + self.high.len) / 2;
        while self.low.len > half {
            let Some(key) = self.low.last() else { break };
            self.low.remove(key);
            self.high.insert(key);
        }
        while self.low.len < half {
            let Some(key) = self.high.first() else { break };
            self.high.remove(key);
            self.low.insert(key);
        }
    }

    /// The median of the positive finite ratios (the element a sort would put at `n / 2`),
    /// 1 without any.
    pub fn median(&self) -> f64 {
        self.high.first().map_or(1.0, f64::from_bits)
    }

    /// The smallest ratio (NaN if any is NaN), `None` without any.
    pub fn min(&self) -> Option<f64> {
        if self.nan > 0 {
            return Some(f64::NAN);
        }
        let positive = self.low.first().or(self.high.first()).map(f64::from_bits);
        let other = self.other.first().map(from_total_key);
        match (positive, other) {
            (Some(p), Some(o)) => Some(if o <= p { o } else { p }),
            (p, o) => p.or(o),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// The estimator's former full pass: the fold for the minimum, a selection for the median.
    fn naive(values: &[f64]) -> (f64, Option<f64>) {
        let min = values.iter().copied().fold(None, |m: Option<f64>, r| {
            Some(match m {
                Some(m) if m.is_nan() || m <= r => m,
                _ => r,
            })
        });
        let mut positive: Vec<f64> = values
            .iter()
            .copied()
            .filter(|r| r.is_finite() && *r > 0.0)
            .collect();
        let mid = positive.len() / 2;
        let median = if positive.is_empty() {
            1.0
        } else {
            *positive.select_nth_unstable_by(mid, f64::total_cmp).1
        };
        (median, min)
    }

    fn same(a: Option<f64>, b: Option<f64>) -> bool {
        match (a, b) {
            (Some(a), Some(b)) => a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
            (None, None) => true,
            _ => false,
        }
    }

    fn draw(rng: &mut StdRng) -> f64 {
        match rng.random_range(0..40) {
            0 => f64::NAN,
            1 => f64::INFINITY,
            2 => 0.0,
            3 => -1.5,
            // Few distinct values, so duplicates straddle the halves' boundary.
            4..=19 => f64::from(rng.random_range(1..6u32)) * 0.25,
            _ => rng.random_range(0.01..10.0),
        }
    }

    #[test]
    fn median_and_min_match_a_full_pass_over_random_changes() {
        let mut rng = StdRng::seed_from_u64(7);
        for _ in 0..200 {
            let mut ratios = Ratios::default();
            let mut values: Vec<f64> = Vec::new();
            for _ in 0..rng.random_range(1..120) {
                if !values.is_empty() && rng.random_bool(0.4) {
                    let v = values.swap_remove(rng.random_range(0..values.len()));
                    ratios.remove(v);
                } else {
                    let v = draw(&mut rng);
                    values.push(v);
                    ratios.insert(v);
                }
                let (median, min) = naive(&values);
                assert_eq!(ratios.median().to_bits(), median.to_bits(), "{values:?}");
                assert!(same(ratios.min(), min), "{values:?}: {:?}", ratios.min());
            }
        }
    }

    #[test]
    fn empty_has_median_one_and_no_minimum() {
        let mut ratios = Ratios::default();
        assert_eq!(ratios.median(), 1.0);
        assert_eq!(ratios.min(), None);
        ratios.insert(2.0);
        ratios.remove(2.0);
        assert_eq!((ratios.median(), ratios.min()), (1.0, None));
    }
}
