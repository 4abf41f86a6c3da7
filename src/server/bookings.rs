//! `serve`'s flags bounding held bookings (ARCHITECTURE.md §3, "Held bookings"): how long a
//! booked prefill counts without a first byte, and how long a rank's engine may not show its
//! bookings before they are reconciled. Owns the flags and their range checks only; the bounds
//! themselves are the core's (`kvpick_core::BookingBounds`).

use std::time::Duration;

use clap::Args;
use kvpick_core::BookingBounds;

/// What a booking's load is believed for without the engine's evidence.
#[derive(Debug, Clone, Args)]
pub struct BookingArgs {
    /// A booking's prefill stops counting toward its rank's load (saturation, cost) once this
    /// many times its predicted TTFT has passed since its pick without a first response byte;
    /// its request slot and KV blocks keep counting until its stream ends. Bounds how long a
    /// client that never sends the response phase holds a rank's prefill capacity. At least 1.
    #[arg(
        long,
        default_value_t = 3.0,
        value_name = "X",
        help_heading = "Held bookings"
    )]
    pub booking_prefill_margin: f64,

    /// ... but never sooner than this many milliseconds after the pick, however short the
    /// prediction (short prompts, a cold estimator).
    #[arg(
        long,
        default_value_t = 2000,
        value_name = "MS",
        help_heading = "Held bookings"
    )]
    pub booking_prefill_floor_ms: u64,

    /// With --engine-metrics: a rank whose engine showed fewer requests (running + waiting) than
    /// kvpick has booked on it on every reading for this many milliseconds has its booked load
    /// brought down to what the engine shows, oldest bookings first (each at least this old);
    /// they stay booked until their streams end. 0 = never. At least 4 scrape intervals.
    #[arg(
        long,
        default_value_t = 15_000,
        value_name = "MS",
        help_heading = "Held bookings"
    )]
    pub booking_reconcile_after_ms: u64,
}

impl BookingArgs {
    /// The core's bounds, checked; `scrape_interval`: the engine scraper's, when it runs.
    pub fn bounds(&self, scrape_interval: Option<Duration>) -> anyhow::Result<BookingBounds> {
        let margin = self.booking_prefill_margin;
        if !(margin.is_finite() && margin >= 1.0) {
            anyhow::bail!("--booking-prefill-margin must be a finite number >= 1, got {margin}");
        }
        if self.booking_prefill_floor_ms > 3_600_000 {
            anyhow::bail!(
                "--booking-prefill-floor-ms must be at most 3600000, got {}",
                self.booking_prefill_floor_ms
            );
        }
        let reconcile_after = match self.booking_reconcile_after_ms {
            0 => None,
            ms => Some(Duration::from_millis(ms)),
        };
        if let (Some(after), Some(interval)) = (reconcile_after, scrape_interval) {
            // A window of a few readings: one odd reading (a scrape between a request's end at
            // the engine and its stream's end here) must never decide alone.
            if after < interval.saturating_mul(4) {
                anyhow::bail!(
                    "--booking-reconcile-after-ms ({} ms) must be at least 4 engine-metrics \
                     intervals ({} ms)",
                    after.as_millis(),
                    interval.saturating_mul(4).as_millis()
                );
            }
        }
        Ok(BookingBounds {
            prefill_margin: margin,
            prefill_floor: Duration::from_millis(self.booking_prefill_floor_ms),
            reconcile_after,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(margin: f64, floor: u64, after: u64) -> BookingArgs {
        BookingArgs {
            booking_prefill_margin: margin,
            booking_prefill_floor_ms: floor,
            booking_reconcile_after_ms: after,
        }
    }

    #[test]
    fn bounds_at_their_limits_pass_and_just_over_fail() {
        let ms = Duration::from_millis;
        assert!(args(1.0, 0, 0).bounds(None).is_ok());
        assert!(args(0.999, 0, 0).bounds(None).is_err());
        assert!(args(f64::INFINITY, 0, 0).bounds(None).is_err());
        assert!(args(3.0, 3_600_000, 0).bounds(None).is_ok());
        assert!(args(3.0, 3_600_001, 0).bounds(None).is_err());
        assert!(args(3.0, 2000, 200).bounds(Some(ms(50))).is_ok());
        assert!(args(3.0, 2000, 199).bounds(Some(ms(50))).is_err());
        let b = args(3.0, 2000, 0).bounds(Some(ms(50))).unwrap();
        assert_eq!(b.reconcile_after, None);
        assert_eq!(
            b,
            BookingBounds {
                reconcile_after: None,
                ..BookingBounds::default()
            }
        );
    }
}
