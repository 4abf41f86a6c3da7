//! Per-rank outlier detection (ARCHITECTURE.md §3b), as values: Envoy's consecutive-5xx detector
//! for the endpoints kvpick picks (its picks bypass Envoy's own load balancing, and so Envoy's
//! outlier detection).
//!
//! Owns [`OutlierConfig`] and [`RankHealth`], one per rank: `consecutive_failures` 5xx responses
//! or connect failures in a row eject the rank from picks for `base_ejection × ejections`
//! (capped at `max_ejection`); when that time has passed one request — the half-open probe — may
//! go to it: a success returns the rank, a failure ejects it again for longer. The multiplier
//! decays by one per `base_ejection` of health. It must not touch partitions or bookings: the
//! partition decides whether an ejection is allowed (at most `max_ejected_percent` of its ranks)
//! and feeds the outcomes. KV events are not its business: an engine whose HTTP path fails may
//! still publish them, and they still count.

use std::time::{Duration, Instant};

/// When a rank is ejected, and for how long.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OutlierConfig {
    /// Consecutive 5xx / connect failures that eject a rank; 0 = never eject.
    pub consecutive_failures: u32,
    /// The first ejection's length; the n-th lasts n times as long.
    pub base_ejection: Duration,
    /// Longest ejection.
    pub max_ejection: Duration,
    /// Most ranks of one partition ejected at once, in percent (rounded down).
    pub max_ejected_percent: u32,
}

impl Default for OutlierConfig {
    fn default() -> Self {
        OutlierConfig {
            consecutive_failures: 5,
            base_ejection: Duration::from_secs(30),
            max_ejection: Duration::from_secs(300),
            max_ejected_percent: 50,
        }
    }
}

impl OutlierConfig {
    /// How many of `ranks` may be ejected at once.
    pub fn max_ejected(&self, ranks: usize) -> usize {
        ranks.saturating_mul(self.max_ejected_percent.min(100) as usize) / 100
    }
}

/// What an outcome did to a rank's standing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HealthEvent {
    /// Taken out of picks.
    Ejected,
    /// Its probe failed: out again, for longer.
    Reejected,
    /// Its probe succeeded: back in picks.
    Returned,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
enum Standing {
    #[default]
    Healthy,
    /// Out of picks until `until`; then one probe may be booked.
    Ejected { until: Instant },
    /// The probe is in flight: no other request goes there until it answers.
    Probing,
}

/// One rank's outlier state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RankHealth {
    consecutive: u32,
    ejections: u32,
    standing: Standing,
    /// Since when the multiplier last decayed (or the rank returned).
    healthy_since: Option<Instant>,
}

impl RankHealth {
    /// Whether a pick may go to the rank now (healthy, or its ejection has passed and no probe
    /// is in flight).
    pub fn available(&self, now: Instant) -> bool {
        match self.standing {
            Standing::Healthy => true,
            Standing::Ejected { until } => now >= until,
            Standing::Probing => false,
        }
    }

    /// Out of normal service: ejected or probing (for the 50% cap and the gauge).
    pub fn is_ejected(&self) -> bool {
        self.standing != Standing::Healthy
    }

    /// In normal service (not ejected, not half-open).
    pub fn in_service(&self) -> bool {
        self.standing == Standing::Healthy
    }

    /// A request was booked on the rank; returns whether it is the half-open probe.
    pub fn on_booked(&mut self, now: Instant) -> bool {
        match self.standing {
            Standing::Ejected { until } if now >= until => {
                self.standing = Standing::Probing;
                true
            }
            _ => false,
        }
    }

    /// The probe ended without an answer (its client went away): another may be sent.
    pub fn probe_abandoned(&mut self, now: Instant) {
        if self.standing == Standing::Probing {
            self.standing = Standing::Ejected { until: now };
        }
    }

    /// A response that was not a server failure; `probe`: the answer of the half-open probe.
    /// While a probe is out only its own answer counts: a late answer of a request booked before
    /// the ejection says nothing about the engine now.
    pub fn on_success(
        &mut self,
        now: Instant,
        config: &OutlierConfig,
        probe: bool,
    ) -> Option<HealthEvent> {
        if self.standing == Standing::Probing && !probe {
            return None;
        }
        self.consecutive = 0;
        match self.standing {
            Standing::Probing => {
                self.standing = Standing::Healthy;
                self.healthy_since = Some(now);
                Some(HealthEvent::Returned)
            }
            Standing::Healthy => {
                let decays = self
                    .healthy_since
                    .is_some_and(|t| now.saturating_duration_since(t) >= config.base_ejection);
                if self.ejections > 0 && decays {
                    self.ejections -= 1;
                    self.healthy_since = Some(now);
                }
                None
            }
            Standing::Ejected { .. } => None,
        }
    }

    /// A 5xx or connect failure. `may_eject`: the partition's cap leaves room for one more
    /// ejection; `probe`: as for [`RankHealth::on_success`].
    pub fn on_failure(
        &mut self,
        now: Instant,
        config: &OutlierConfig,
        may_eject: bool,
        probe: bool,
    ) -> Option<HealthEvent> {
        if config.consecutive_failures == 0 {
            return None;
        }
        match self.standing {
            Standing::Probing if !probe => None,
            Standing::Probing => {
                self.eject(now, config);
                Some(HealthEvent::Reejected)
            }
            Standing::Healthy => {
                self.consecutive = self.consecutive.saturating_add(1);
                if self.consecutive >= config.consecutive_failures && may_eject {
                    self.eject(now, config);
                    Some(HealthEvent::Ejected)
                } else {
                    None
                }
            }
            // A late answer of a request booked before the ejection.
            Standing::Ejected { .. } => None,
        }
    }

    fn eject(&mut self, now: Instant, config: &OutlierConfig) {
        self.ejections = self.ejections.saturating_add(1);
        self.consecutive = 0;
        let length = config
            .base_ejection
            .saturating_mul(self.ejections)
            .min(config.max_ejection);
        self.standing = Standing::Ejected {
            until: now.checked_add(length).unwrap_or(now),
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> OutlierConfig {
        OutlierConfig {
            consecutive_failures: 5,
            base_ejection: Duration::from_secs(10),
            max_ejection: Duration::from_secs(25),
            max_ejected_percent: 50,
        }
    }

    #[test]
    fn five_consecutive_failures_eject_four_do_not_and_a_success_resets() {
        let (c, t0) = (cfg(), Instant::now());
        let mut h = RankHealth::default();
        for _ in 0..4 {
            assert_eq!(h.on_failure(t0, &c, true, false), None);
        }
        assert_eq!(h.on_success(t0, &c, false), None, "the run is broken");
        for _ in 0..4 {
            assert_eq!(h.on_failure(t0, &c, true, false), None);
        }
        assert!(h.available(t0));
        assert_eq!(
            h.on_failure(t0, &c, true, false),
            Some(HealthEvent::Ejected)
        );
        assert!(!h.available(t0));
        assert!(h.is_ejected());
    }

    #[test]
    fn the_cap_holds_an_ejection_back() {
        let (c, t0) = (cfg(), Instant::now());
        let mut h = RankHealth::default();
        for _ in 0..10 {
            assert_eq!(h.on_failure(t0, &c, false, false), None);
        }
        assert!(h.available(t0));
        // Room again: the next failure of the run ejects.
        assert_eq!(
            h.on_failure(t0, &c, true, false),
            Some(HealthEvent::Ejected)
        );
        assert_eq!(c.max_ejected(4), 2);
        assert_eq!(c.max_ejected(3), 1);
        assert_eq!(c.max_ejected(1), 0);
    }

    #[test]
    fn a_half_open_probe_returns_the_rank_or_ejects_it_for_longer() {
        let (c, t0) = (cfg(), Instant::now());
        let mut h = RankHealth::default();
        for _ in 0..5 {
            h.on_failure(t0, &c, true, false);
        }
        let s = Duration::from_secs;
        assert!(!h.available(t0 + s(9)));
        assert!(h.available(t0 + s(10)), "base time passed: a probe may go");
        assert!(h.on_booked(t0 + s(10)), "this booking is the probe");
        assert!(!h.available(t0 + s(10)), "one probe at a time");
        assert!(!h.on_booked(t0 + s(10)));
        let t1 = t0 + s(11);
        assert_eq!(
            h.on_failure(t1, &c, true, true),
            Some(HealthEvent::Reejected)
        );
        assert!(!h.available(t1 + s(19)), "second ejection: 2 x base");
        assert!(h.available(t1 + s(20)));
        assert!(h.on_booked(t1 + s(20)));
        // An abandoned probe lets another go.
        h.probe_abandoned(t1 + s(20));
        assert!(h.available(t1 + s(20)));
        assert!(h.on_booked(t1 + s(20)));
        assert_eq!(
            h.on_failure(t1 + s(21), &c, true, true),
            Some(HealthEvent::Reejected)
        );
        assert!(
            !h.available(t1 + s(21) + s(24)),
            "capped at max_ejection (25 s)"
        );
        assert!(h.available(t1 + s(21) + s(25)));
        assert!(h.on_booked(t1 + s(46)));
        assert_eq!(
            h.on_success(t1 + s(47), &c, true),
            Some(HealthEvent::Returned)
        );
        assert!(!h.is_ejected());
        assert!(h.available(t1 + s(47)));
    }

    #[test]
    fn the_multiplier_decays_with_health_and_zero_never_ejects() {
        let (c, t0) = (cfg(), Instant::now());
        let s = Duration::from_secs;
        let mut h = RankHealth::default();
        for _ in 0..5 {
            h.on_failure(t0, &c, true, false);
        }
        h.on_booked(t0 + s(10));
        h.on_success(t0 + s(10), &c, true);
        // Healthy for one base time: the next ejection is base x 1 again.
        h.on_success(t0 + s(20), &c, false);
        for _ in 0..5 {
            h.on_failure(t0 + s(21), &c, true, false);
        }
        assert!(h.available(t0 + s(31)));
        let off = OutlierConfig {
            consecutive_failures: 0,
            ..c
        };
        let mut h = RankHealth::default();
        for _ in 0..100 {
            assert_eq!(h.on_failure(t0, &off, true, false), None);
        }
        assert!(h.available(t0));
    }

    #[test]
    fn while_a_probe_is_out_only_its_answer_counts() {
        let (c, t0) = (cfg(), Instant::now());
        let s = Duration::from_secs;
        let mut h = RankHealth::default();
        for _ in 0..5 {
            h.on_failure(t0, &c, true, false);
        }
        assert!(h.on_booked(t0 + s(10)));
        // Late answers of requests booked before the ejection, either way: no verdict.
        assert_eq!(h.on_success(t0 + s(10), &c, false), None);
        assert_eq!(h.on_failure(t0 + s(10), &c, true, false), None);
        assert!(h.is_ejected() && !h.available(t0 + s(10)));
        assert_eq!(
            h.on_failure(t0 + s(10), &c, true, true),
            Some(HealthEvent::Reejected)
        );
    }
}
