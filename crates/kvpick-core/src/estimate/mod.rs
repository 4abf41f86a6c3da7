//! The time-to-first-token estimator (ARCHITECTURE.md §4): learns, per partition, how long a
//! request waits for its first token as a function of the prefill work ahead of it and its own
//! uncached prefill, from the partition's own observations (pick -> first response byte). It owns
//! the fits and nothing else: the partition feeds it observations and reads coefficients; the
//! decision ([`crate::decide`]) uses them through [`Candidate`](crate::decide::Candidate) fields.
//! No clock and no I/O: an observation is a number of seconds the caller measured.
//!
//! The model is the one an engine with a FIFO prefill queue obeys:
//! `ttft(rank) = scale(rank) × (fixed + seconds_per_token × tokens)` where `tokens` is the
//! uncached prefill queued on the rank plus the request's own uncached prefill.
//! - `fixed` and `seconds_per_token` are an exponentially weighted least-squares line over every
//!   observation of the partition (recent observations count more, so it follows a change of
//!   engine, model or batch mix);
//! - `scale(rank)` is the rank's exponentially weighted ratio of observed to predicted TTFT,
//!   relative to the median ratio of the partition's ranks (so the typical rank is 1 and the line
//!   carries the fleet's speed) and clamped to `[1/MAX_SCALE, MAX_SCALE]`: a slower GPU, a rank
//!   with load kvpick does not see, or a rank behind a slower network gets a factor above 1 and
//!   is charged for it. The line learns from observations divided by their rank's scale, so one
//!   slow rank does not make the whole partition look slow.
//!
//! Until enough observations exist the line is the prior (an 8B-class model on one modern GPU);
//! the prior only sets the units of the estimate: the decision compares candidates, and while
//! every rank has the same coefficients it does not depend on them.

use std::collections::HashMap;

use crate::types::RankKey;

mod ratios;

/// A rank's factor never leaves `[1/MAX_SCALE, MAX_SCALE]`: one stalled response must not
/// make a rank look 100x slower for the next thousand picks.
pub const MAX_SCALE: f64 = 4.0;

/// A rank within this fraction of the median rank's speed has scale exactly 1: timing noise must
/// not turn ties between equal ranks (broken uniformly at random) into a fixed preference for
/// whichever rank happened to answer a little faster.
pub const SCALE_DEADBAND: f64 = 0.15;

/// Seconds added to both sides of a rank's observed/predicted ratio: a rank whose first tokens
/// take 3 ms where others take 2 ms is not "50% slower" in any way a request notices, while one
/// taking 3 s where others take 2 s is.
pub const SCALE_TIME_FLOOR: f64 = 0.05;

/// Estimator settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EstimatorConfig {
    /// Learn from observations; `false` keeps the prior (every rank scale 1).
    pub calibrate: bool,
    /// Prior slope, seconds of prefill per uncached token.
    pub prior_seconds_per_token: f64,
    /// Prior intercept, seconds.
    pub prior_fixed_seconds: f64,
    /// Observations after which an old one weighs half as much (the partition's line).
    pub half_life: f64,
    /// The same for each rank's scale.
    pub rank_half_life: f64,
    /// Observations (effective weight) before the line replaces the prior, and before a
    /// rank's scale leaves 1.
    pub min_observations: f64,
}

impl Default for EstimatorConfig {
    fn default() -> Self {
        EstimatorConfig {
            calibrate: true,
            prior_seconds_per_token: 50e-6,
            prior_fixed_seconds: 0.02,
            half_life: 512.0,
            rank_half_life: 64.0,
            min_observations: 16.0,
        }
    }
}

/// The current line: `ttft = fixed_seconds + seconds_per_token × tokens` (before a rank's scale).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Coefficients {
    pub fixed_seconds: f64,
    pub seconds_per_token: f64,
}

impl Coefficients {
    pub fn predict(&self, tokens: f64) -> f64 {
        self.fixed_seconds + self.seconds_per_token * tokens.max(0.0)
    }
}

/// Exponentially weighted sums for a least-squares line.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Sums {
    w: f64,
    x: f64,
    y: f64,
    xx: f64,
    xy: f64,
}

impl Sums {
    fn add(&mut self, x: f64, y: f64, decay: f64) {
        self.w = self.w * decay + 1.0;
        self.x = self.x * decay + x;
        self.y = self.y * decay + y;
        self.xx = self.xx * decay + x * x;
        self.xy = self.xy * decay + x * y;
    }
}

/// A rank's observed and predicted TTFT sums (for its scale).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct RankSums {
    w: f64,
    observed: f64,
    predicted: f64,
}

/// `2^(-1/half_life)`: the factor that halves a weight over `half_life` observations.
fn decay_for(half_life: f64) -> f64 {
    if half_life.is_finite() && half_life > 0.0 {
        (-std::f64::consts::LN_2 / half_life).exp()
    } else {
        1.0
    }
}

/// One partition's estimator.
#[derive(Debug, Clone)]
pub struct TtftEstimator {
    config: EstimatorConfig,
    decay: f64,
    rank_decay: f64,
    line: Sums,
    ranks: HashMap<RankKey, RankSums>,
    /// The ratios of the ranks with `min_observations`, kept in order as they change.
    ratios: ratios::Ratios,
    /// Median observed/predicted ratio over the ranks with `min_observations`, refreshed on every
    /// observation (1 until one has).
    median_ratio: f64,
    /// The smallest of those ratios (refreshed with the median): [`TtftEstimator::min_scale`].
    min_ratio: Option<f64>,
    /// Cached result of [`TtftEstimator::coefficients`], refreshed on every observation.
    coefficients: Coefficients,
}

impl TtftEstimator {
    pub fn new(config: EstimatorConfig) -> Self {
        TtftEstimator {
            config,
            decay: decay_for(config.half_life),
            rank_decay: decay_for(config.rank_half_life),
            line: Sums::default(),
            ranks: HashMap::new(),
            ratios: ratios::Ratios::default(),
            median_ratio: 1.0,
            min_ratio: None,
            coefficients: Self::prior(&config),
        }
    }

    fn prior(config: &EstimatorConfig) -> Coefficients {
        Coefficients {
            fixed_seconds: config.prior_fixed_seconds.max(0.0),
            seconds_per_token: config.prior_seconds_per_token.max(f64::MIN_POSITIVE),
        }
    }

    /// The partition's line (the prior until `min_observations`).
    pub fn coefficients(&self) -> Coefficients {
        self.coefficients
    }

    /// The rank's factor on the line (1 until it has `min_observations` of its own).
    pub fn rank_scale(&self, key: &RankKey) -> f64 {
        let Some(ratio) = self.ranks.get(key).and_then(|r| self.ratio(r)) else {
            return 1.0;
        };
        self.scale_of(ratio)
    }

    /// No rank's [`TtftEstimator::rank_scale`] is below this: the scale grows with the ratio,
    /// so the smallest ratio gives it (and a rank without one has 1). A decision that skips
    /// ranks uses it to bound what they could cost ([`crate::decide`]).
    pub fn min_scale(&self) -> f64 {
        match self.min_ratio {
            Some(r) if r.is_finite() => self.scale_of(r).min(1.0),
            Some(_) => 0.0,
            None => 1.0,
        }
    }

    fn scale_of(&self, ratio: f64) -> f64 {
        let scale = ratio / self.median_ratio;
        if (scale - 1.0).abs() <= SCALE_DEADBAND {
            return 1.0;
        }
        scale.clamp(1.0 / MAX_SCALE, MAX_SCALE)
    }

    fn ratio(&self, r: &RankSums) -> Option<f64> {
        (r.w >= self.config.min_observations && r.predicted > 0.0).then(|| r.observed / r.predicted)
    }

    /// Predicted TTFT in seconds on `key` with `tokens` of uncached prefill ahead of and including
    /// the request's own.
    pub fn predict(&self, key: &RankKey, tokens: f64) -> f64 {
        self.rank_scale(key) * self.coefficients.predict(tokens)
    }

    /// Predicted wait on `key` for `tokens` of prefill already queued there (no fixed time).
    pub fn predict_wait(&self, key: &RankKey, tokens: f64) -> f64 {
        self.rank_scale(key) * self.coefficients.seconds_per_token * tokens.max(0.0)
    }

    /// A request booked on `key` with `tokens` of prefill work (as at its pick) saw its first
    /// token after `observed_seconds`.
    pub fn observe(&mut self, key: RankKey, tokens: f64, observed_seconds: f64) {
        if !self.config.calibrate
            || !tokens.is_finite()
            || !observed_seconds.is_finite()
            || tokens < 0.0
            || observed_seconds < 0.0
        {
            return;
        }
        // The rank's scale compares against the line as it was before this observation, and the
        // line sees the observation at the rank's scale, so a slow rank moves its own scale, not
        // the partition's line.
        let scale = self.rank_scale(&key);
        let predicted = self.coefficients.predict(tokens);
        let rank = self.ranks.entry(key).or_default();
        let before = *rank;
        rank.w = rank.w * self.rank_decay + 1.0;
        rank.observed = rank.observed * self.rank_decay + observed_seconds + SCALE_TIME_FLOOR;
        rank.predicted = rank.predicted * self.rank_decay + predicted + SCALE_TIME_FLOOR;
        let after = *rank;
        self.line.add(tokens, observed_seconds / scale, self.decay);
        self.coefficients = self.fit();
        if let Some(ratio) = self.ratio(&before) {
            self.ratios.remove(ratio);
        }
        if let Some(ratio) = self.ratio(&after) {
            self.ratios.insert(ratio);
        }
        self.refresh_median_ratio();
    }

    /// The median, not the mean: one stalled rank must not make every other rank look fast.
    /// The minimum is taken over every ratio, finite or not (a rank's scale uses its ratio
    /// as it is), so [`TtftEstimator::min_scale`] stays a true lower bound.
    fn refresh_median_ratio(&mut self) {
        self.min_ratio = self.ratios.min();
        self.median_ratio = self.ratios.median();
    }

    /// Forgets a rank that left the partition.
    pub fn forget(&mut self, key: &RankKey) {
        if let Some(ratio) = self.ranks.remove(key).and_then(|r| self.ratio(&r)) {
            self.ratios.remove(ratio);
        }
        self.refresh_median_ratio();
    }

    /// The weighted least-squares line, or the prior's slope through the observed means when the
    /// observations cannot pin a positive slope (all the same size, or noise with no trend).
    fn fit(&self) -> Coefficients {
        let prior = Self::prior(&self.config);
        let s = &self.line;
        if s.w < self.config.min_observations {
            return prior;
        }
        let mean_x = s.x / s.w;
        let mean_y = s.y / s.w;
        let var_x = s.xx / s.w - mean_x * mean_x;
        let cov = s.xy / s.w - mean_x * mean_y;
        // A slope is believable only if the prompts varied (relative spread of at least 1%).
        let spread = var_x.max(0.0).sqrt();
        let slope = if spread > 0.01 * mean_x.abs().max(1.0) && cov > 0.0 {
            cov / var_x
        } else {
            prior.seconds_per_token
        };
        // Bounded to a factor of 1000 either side of the prior: a fit outside that is a
        // measurement problem, not an engine.
        let slope = slope.clamp(
            prior.seconds_per_token / 1000.0,
            prior.seconds_per_token * 1000.0,
        );
        let fixed = (mean_y - slope * mean_x).max(0.0);
        Coefficients {
            fixed_seconds: fixed,
            seconds_per_token: slope,
        }
    }
}

/// The time-per-output-token estimator (flow control's `x-llm-d-slo-tpot-ms`): per partition, an
/// exponentially weighted least-squares line `tpot = base + per_request × batch`, where `batch`
/// is the number of requests booked on the rank when the request's first token arrived (the
/// engine decodes them together, so every one of them slows each step). Observations are the
/// host's: decode time (first token to end of stream) over the output tokens after the first.
/// The prior (10 ms + 0.1 ms per request, an 8B-class model on one modern GPU) only sets units
/// until `min_observations`.
#[derive(Debug, Clone)]
pub struct TpotEstimator {
    calibrate: bool,
    min_observations: f64,
    decay: f64,
    line: Sums,
    coefficients: (f64, f64),
}

/// Prior TPOT line: seconds per token at batch 0, and per request in the batch.
const PRIOR_TPOT: (f64, f64) = (0.010, 0.0001);

impl TpotEstimator {
    pub fn new(config: EstimatorConfig) -> Self {
        TpotEstimator {
            calibrate: config.calibrate,
            min_observations: config.min_observations,
            decay: decay_for(config.half_life),
            line: Sums::default(),
            coefficients: PRIOR_TPOT,
        }
    }

    /// Predicted seconds per output token on a rank decoding `batch` requests.
    pub fn predict(&self, batch: f64) -> f64 {
        let (base, per_request) = self.coefficients;
        base + per_request * batch.max(0.0)
    }

    /// A request that decoded alongside `batch` requests took `seconds_per_token`.
    pub fn observe(&mut self, batch: f64, seconds_per_token: f64) {
        if !self.calibrate
            || !batch.is_finite()
            || !seconds_per_token.is_finite()
            || batch < 0.0
            || seconds_per_token < 0.0
        {
            return;
        }
        self.line.add(batch, seconds_per_token, self.decay);
        self.coefficients = self.fit();
    }

    fn fit(&self) -> (f64, f64) {
        let s = &self.line;
        if s.w < self.min_observations {
            return PRIOR_TPOT;
        }
        let mean_x = s.x / s.w;
        let mean_y = s.y / s.w;
        let var_x = s.xx / s.w - mean_x * mean_x;
        let cov = s.xy / s.w - mean_x * mean_y;
        // Without a spread of batch sizes the slope is not identified: keep the prior's.
        let slope = if var_x > 0.25 && cov > 0.0 {
            cov / var_x
        } else {
            PRIOR_TPOT.1
        };
        let slope = slope.clamp(PRIOR_TPOT.1 / 1000.0, PRIOR_TPOT.1 * 1000.0);
        ((mean_y - slope * mean_x).max(0.0), slope)
    }
}

impl Default for TpotEstimator {
    fn default() -> Self {
        Self::new(EstimatorConfig::default())
    }
}

impl Default for TtftEstimator {
    fn default() -> Self {
        Self::new(EstimatorConfig::default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rank(w: u64) -> RankKey {
        RankKey {
            worker_id: w,
            dp_rank: 0,
        }
    }

    #[test]
    fn tpot_learns_how_the_batch_slows_decoding() {
        let mut e = TpotEstimator::default();
        assert_eq!(e.predict(0.0), 0.010);
        // An engine at 20 ms/token alone, +1 ms per request decoding alongside.
        for i in 0..400u32 {
            let batch = f64::from(i % 32);
            e.observe(batch, 0.020 + 0.001 * batch);
        }
        assert!((e.predict(0.0) - 0.020).abs() < 1e-4, "{}", e.predict(0.0));
        assert!(
            (e.predict(10.0) - 0.030).abs() < 1e-4,
            "{}",
            e.predict(10.0)
        );
        let mut fixed = TpotEstimator::new(EstimatorConfig {
            calibrate: false,
            ..Default::default()
        });
        fixed.observe(3.0, 1.0);
        assert_eq!(fixed.predict(0.0), 0.010);
    }

    #[test]
    fn prior_until_enough_observations() {
        let mut e = TtftEstimator::default();
        let prior = e.coefficients();
        assert_eq!(prior.seconds_per_token, 50e-6);
        for i in 0..10 {
            e.observe(rank(1), 1000.0 * f64::from(i), 1.0);
        }
        assert_eq!(e.coefficients(), prior);
        assert_eq!(e.rank_scale(&rank(1)), 1.0);
    }

    #[test]
    fn learns_an_engines_line() {
        // An engine at 10 ms fixed + 100 µs/token (twice the prior's slope).
        let mut e = TtftEstimator::default();
        for i in 0..400u32 {
            let tokens = f64::from((i * 7919) % 20_000);
            e.observe(rank(i as u64 % 4), tokens, 0.010 + 100e-6 * tokens);
        }
        let c = e.coefficients();
        assert!((c.seconds_per_token - 100e-6).abs() < 1e-7, "{c:?}");
        assert!((c.fixed_seconds - 0.010).abs() < 1e-3, "{c:?}");
        // Homogeneous ranks keep scale 1 once the line has converged (within the deadband).
        for w in 0..4 {
            assert_eq!(e.rank_scale(&rank(w)), 1.0, "rank {w}");
        }
        let p = e.predict(&rank(0), 5000.0);
        assert!((p - 0.51).abs() < 0.03, "{p}");
    }

    #[test]
    fn a_slow_rank_gets_a_scale_above_one() {
        let mut e = TtftEstimator::default();
        for i in 0..2000u32 {
            let tokens = f64::from(500 + (i * 104_729) % 8000);
            let w = u64::from(i % 4);
            let speed = if w == 3 { 2.0 } else { 1.0 };
            e.observe(rank(w), tokens, speed * (0.005 + 50e-6 * tokens));
        }
        let slow = e.rank_scale(&rank(3));
        let fast = e.rank_scale(&rank(0));
        assert!(slow > 1.5 * fast, "slow {slow} fast {fast}");
        assert!(e.predict(&rank(3), 4000.0) > 1.5 * e.predict(&rank(0), 4000.0));
    }

    #[test]
    fn ranks_within_the_deadband_keep_scale_one() {
        // Two ranks 8% apart (rank 2 slower) whose first tokens also jitter by ±5%.
        let mut e = TtftEstimator::default();
        for i in 0..1000u32 {
            let t = f64::from(200 + i * 31 % 4000);
            let w = u64::from(i % 2) + 1;
            let jitter = if i % 3 == 0 { 1.05 } else { 0.95 };
            let speed = if w == 2 { 1.08 } else { 1.0 };
            e.observe(rank(w), t, speed * jitter * (0.01 + 50e-6 * t));
        }
        assert_eq!(e.rank_scale(&rank(1)), 1.0);
        assert_eq!(e.rank_scale(&rank(2)), 1.0);
    }

    #[test]
    fn milliseconds_of_difference_on_tiny_first_tokens_are_not_a_slower_rank() {
        // Rank 2 answers in 3 ms where rank 1 takes 2 ms (a test's fake upstreams).
        let mut e = TtftEstimator::default();
        for i in 0..400u32 {
            let w = u64::from(i % 2) + 1;
            e.observe(
                rank(w),
                f64::from(i % 7),
                if w == 2 { 0.003 } else { 0.002 },
            );
        }
        assert_eq!(e.rank_scale(&rank(1)), 1.0);
        assert_eq!(e.rank_scale(&rank(2)), 1.0);
    }

    #[test]
    fn follows_a_change_of_engine() {
        let mut e = TtftEstimator::default();
        for i in 0..1000u32 {
            let t = f64::from(i % 10_000 * 13 % 10_000);
            e.observe(rank(1), t, 20e-6 * t);
        }
        assert!((e.coefficients().seconds_per_token - 20e-6).abs() < 2e-6);
        // The model got three times slower: after a few half-lives the line follows.
        for i in 0..3000u32 {
            let t = f64::from(i % 10_000 * 17 % 10_000);
            e.observe(rank(1), t, 60e-6 * t);
        }
        let s = e.coefficients().seconds_per_token;
        assert!((s - 60e-6).abs() < 6e-6, "{s}");
    }

    #[test]
    fn degenerate_observations_keep_a_positive_slope() {
        let mut e = TtftEstimator::default();
        // Every prompt the same size: no slope can be fitted; the prior's slope goes through
        // the observed mean.
        for _ in 0..100 {
            e.observe(rank(1), 1000.0, 0.3);
        }
        let c = e.coefficients();
        assert_eq!(c.seconds_per_token, 50e-6);
        assert!((c.predict(1000.0) - 0.3).abs() < 1e-9);
        // Garbage is ignored.
        e.observe(rank(1), f64::NAN, 1.0);
        e.observe(rank(1), 1.0, -1.0);
        e.observe(rank(1), 1.0, f64::INFINITY);
        assert_eq!(e.coefficients(), c);
    }

    #[test]
    fn calibration_off_keeps_the_prior() {
        let mut e = TtftEstimator::new(EstimatorConfig {
            calibrate: false,
            ..Default::default()
        });
        for i in 0..100u32 {
            e.observe(rank(1), f64::from(i) * 100.0, 9.0);
        }
        assert_eq!(
            e.coefficients(),
            TtftEstimator::prior(&EstimatorConfig::default())
        );
        assert_eq!(e.rank_scale(&rank(1)), 1.0);
    }

    #[test]
    fn one_stalled_rank_is_clamped_and_does_not_move_the_line() {
        let mut e = TtftEstimator::default();
        for i in 0..300u32 {
            let t = f64::from(i * 50 % 10_000);
            for w in 1..8 {
                e.observe(rank(w), t, 0.01 + 80e-6 * t);
            }
            e.observe(rank(8), t, 30.0);
        }
        assert_eq!(e.rank_scale(&rank(8)), MAX_SCALE);
        for w in 1..8 {
            let s = e.rank_scale(&rank(w));
            assert!((0.7..1.1).contains(&s), "rank {w}: {s}");
        }
        let slope = e.coefficients().seconds_per_token;
        assert!(slope < 2.0 * 80e-6, "{slope}");
        e.forget(&rank(8));
        assert_eq!(e.rank_scale(&rank(8)), 1.0);
    }

    #[test]
    fn a_uniformly_slower_fleet_moves_the_line_not_the_scales() {
        let mut e = TtftEstimator::default();
        for i in 0..2000u32 {
            let t = f64::from(i * 37 % 8000);
            e.observe(rank(u64::from(i % 4)), t, 0.05 + 400e-6 * t);
        }
        for w in 0..4 {
            assert!((e.rank_scale(&rank(w)) - 1.0).abs() < 0.05);
        }
        let c = e.coefficients();
        assert!((c.seconds_per_token - 400e-6).abs() < 40e-6, "{c:?}");
    }
}
