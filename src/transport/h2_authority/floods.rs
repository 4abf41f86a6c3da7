//! Rate limits on the client frames h2 answers at a cost the client does not pay: SETTINGS (h2
//! acks each one, and a change of SETTINGS_INITIAL_WINDOW_SIZE walks every open stream: 17–28
//! CPU-seconds in 31 s on a connection with 1,000 open streams, issue 45) and WINDOW_UPDATE (a
//! connection-level one hands capacity to every stream waiting for it). Each connection has a
//! token bucket per kind; a client over its bucket breaks a limit like the other floods
//! ([`Violation::SettingsFlood`], [`Violation::WindowUpdateFlood`]: GOAWAY ENHANCE_YOUR_CALM).
//!
//! WINDOW_UPDATE follows real traffic: a peer legitimately sends about one WINDOW_UPDATE per DATA
//! frame it receives for the stream and one for the connection, so besides its fixed rate and
//! burst the bucket is credited [`WINDOW_UPDATES_PER_DATA_FRAME`] per DATA frame h2 sent on the
//! connection (`sent::SentFrames`), banked up to [`MAX_DATA_CREDIT`]. A busy connection never
//! trips it; a client can only earn credit by making kvpick send it data.
//!
//! Values only: the frame counts and the time are arguments (the layer passes tokio's clock, so
//! paused tests reach it). It never looks at a frame's payload.

use std::time::Instant;

use super::limits::Violation;
use super::streams::FLAG_END_STREAM;

pub const TYPE_SETTINGS: u8 = 0x4;
pub const TYPE_WINDOW_UPDATE: u8 = 0x8;
/// SETTINGS with ACK: the client's answer to h2's own SETTINGS, not counted (h2 refuses an
/// unsolicited one as a protocol error).
const FLAG_ACK: u8 = FLAG_END_STREAM;

/// Default `--http2-max-settings-per-second`: a client sends one SETTINGS at its preface and
/// rarely another.
pub const DEFAULT_SETTINGS_PER_SECOND: u32 = 2;
/// SETTINGS frames a connection may send at once before the rate applies.
pub const SETTINGS_BURST: u32 = 32;
/// Default `--http2-max-window-updates-per-second`, besides the credit from DATA frames.
pub const DEFAULT_WINDOW_UPDATES_PER_SECOND: u32 = 100;
/// WINDOW_UPDATE frames a connection may send at once before the rate applies.
pub const WINDOW_UPDATE_BURST: u32 = 256;
/// WINDOW_UPDATEs a peer may send per DATA frame it received: one for the stream, one for the
/// connection.
pub const WINDOW_UPDATES_PER_DATA_FRAME: u32 = 2;
/// Most WINDOW_UPDATE credit banked from DATA frames sent (a round of answers on 1,024 streams,
/// four DATA frames each, twice over), so credit earned over hours cannot pay for a flood.
pub const MAX_DATA_CREDIT: u32 = 8_192;

/// Each connection's frame rates (`--http2-max-settings-per-second`,
/// `--http2-max-window-updates-per-second`); 0 = unlimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FloodLimits {
    pub settings_per_second: u32,
    pub window_updates_per_second: u32,
}

impl Default for FloodLimits {
    fn default() -> Self {
        FloodLimits {
            settings_per_second: DEFAULT_SETTINGS_PER_SECOND,
            window_updates_per_second: DEFAULT_WINDOW_UPDATES_PER_SECOND,
        }
    }
}

/// Frames of the rate-limited kinds a client sent on one connection so far.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct FrameCounts {
    pub settings: u64,
    pub window_updates: u64,
}

impl FrameCounts {
    /// A client frame header (any kind; only the limited ones count).
    pub fn client_frame(&mut self, kind: u8, flags: u8) {
        match kind {
            TYPE_SETTINGS if flags & FLAG_ACK == 0 => self.settings += 1,
            TYPE_WINDOW_UPDATE => self.window_updates += 1,
            _ => {}
        }
    }
}

/// A token bucket: `rate` tokens a second up to `burst`, plus credit given from outside (banked
/// up to `max_credit`), spent first.
#[derive(Debug)]
struct Bucket {
    rate: f64,
    burst: f64,
    tokens: f64,
    credit: f64,
    max_credit: f64,
    last: Option<Instant>,
}

impl Bucket {
    fn new(rate: u32, burst: u32, max_credit: u32) -> Self {
        Bucket {
            rate: f64::from(rate),
            burst: f64::from(burst),
            tokens: f64::from(burst),
            credit: 0.0,
            max_credit: f64::from(max_credit),
            last: None,
        }
    }

    fn credit(&mut self, n: u64) {
        self.credit = (self.credit + n as f64).min(self.max_credit);
    }

    /// Takes `n` tokens at `now`; false when there are not that many (the bucket is then empty).
    fn take(&mut self, n: u64, now: Instant) -> bool {
        if let Some(last) = self.last {
            let elapsed = now.saturating_duration_since(last).as_secs_f64();
            self.tokens = (self.tokens + elapsed * self.rate).min(self.burst);
        }
        self.last = Some(now);
        let mut need = n as f64;
        let from_credit = need.min(self.credit);
        self.credit -= from_credit;
        need -= from_credit;
        if need > self.tokens {
            self.tokens = 0.0;
            return false;
        }
        self.tokens -= need;
        true
    }
}

/// One connection's flood limits.
#[derive(Debug)]
pub struct FloodGuard {
    settings: Option<Bucket>,
    window_updates: Option<Bucket>,
    /// Counts already charged.
    charged: FrameCounts,
    data_frames_credited: u64,
}

impl FloodGuard {
    pub fn new(limits: FloodLimits) -> Self {
        let bucket = |rate, burst, credit| (rate > 0).then(|| Bucket::new(rate, burst, credit));
        FloodGuard {
            settings: bucket(limits.settings_per_second, SETTINGS_BURST, 0),
            window_updates: bucket(
                limits.window_updates_per_second,
                WINDOW_UPDATE_BURST,
                MAX_DATA_CREDIT,
            ),
            charged: FrameCounts::default(),
            data_frames_credited: 0,
        }
    }

    /// Charges the frames `received` since the last check (totals of the connection so far),
    /// after crediting the DATA frames h2 sent (`data_frames_sent`, a total too).
    pub fn check(
        &mut self,
        received: FrameCounts,
        data_frames_sent: u64,
        now: Instant,
    ) -> Result<(), Violation> {
        if received == self.charged {
            return Ok(());
        }
        let settings = received.settings - self.charged.settings;
        let window_updates = received.window_updates - self.charged.window_updates;
        self.charged = received;
        if let Some(bucket) = &mut self.settings {
            if settings > 0 && !bucket.take(settings, now) {
                return Err(Violation::SettingsFlood);
            }
        }
        if let Some(bucket) = &mut self.window_updates {
            let new_data = data_frames_sent.saturating_sub(self.data_frames_credited);
            self.data_frames_credited = data_frames_sent;
            bucket.credit(new_data * u64::from(WINDOW_UPDATES_PER_DATA_FRAME));
            if window_updates > 0 && !bucket.take(window_updates, now) {
                return Err(Violation::WindowUpdateFlood);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn counts(settings: u64, window_updates: u64) -> FrameCounts {
        FrameCounts {
            settings,
            window_updates,
        }
    }

    #[test]
    fn only_non_ack_settings_and_window_updates_count() {
        let mut c = FrameCounts::default();
        c.client_frame(TYPE_SETTINGS, 0);
        c.client_frame(TYPE_SETTINGS, FLAG_ACK);
        c.client_frame(TYPE_WINDOW_UPDATE, 0);
        c.client_frame(0x0, 0);
        c.client_frame(0x6, 0);
        assert_eq!(c, counts(1, 1));
    }

    #[test]
    fn settings_burst_is_allowed_and_one_more_is_a_flood_until_the_rate_refills() {
        let t0 = Instant::now();
        let mut g = FloodGuard::new(FloodLimits::default());
        let burst = u64::from(SETTINGS_BURST);
        assert_eq!(g.check(counts(burst, 0), 0, t0), Ok(()));
        assert_eq!(
            g.check(counts(burst + 1, 0), 0, t0),
            Err(Violation::SettingsFlood)
        );
        // At the rate (2 a second) a client is never refused.
        let mut g = FloodGuard::new(FloodLimits::default());
        let mut sent = burst;
        g.check(counts(sent, 0), 0, t0).unwrap();
        for s in 1..=100u64 {
            sent += 2;
            let now = t0 + Duration::from_secs(s);
            assert_eq!(g.check(counts(sent, 0), 0, now), Ok(()), "second {s}");
        }
        // 0 = unlimited.
        let mut off = FloodGuard::new(FloodLimits {
            settings_per_second: 0,
            ..FloodLimits::default()
        });
        assert_eq!(off.check(counts(1_000_000, 0), 0, t0), Ok(()));
    }

    #[test]
    fn window_updates_get_a_burst_a_rate_and_credit_per_data_frame_sent() {
        let t0 = Instant::now();
        let burst = u64::from(WINDOW_UPDATE_BURST);
        let mut g = FloodGuard::new(FloodLimits::default());
        assert_eq!(g.check(counts(0, burst), 0, t0), Ok(()));
        assert_eq!(
            g.check(counts(0, burst + 1), 0, t0),
            Err(Violation::WindowUpdateFlood)
        );

        // Two per DATA frame sent on top of the burst: exactly that passes, one more does not.
        let mut g = FloodGuard::new(FloodLimits::default());
        let data = 1_000u64;
        let allowed = burst + 2 * data;
        assert_eq!(g.check(counts(0, allowed), data, t0), Ok(()));
        let mut g = FloodGuard::new(FloodLimits::default());
        assert_eq!(
            g.check(counts(0, allowed + 1), data, t0),
            Err(Violation::WindowUpdateFlood)
        );

        // Credit is banked only up to MAX_DATA_CREDIT.
        let mut g = FloodGuard::new(FloodLimits::default());
        let cap = u64::from(MAX_DATA_CREDIT);
        assert_eq!(
            g.check(counts(0, burst + cap + 1), 1_000_000, t0),
            Err(Violation::WindowUpdateFlood)
        );
    }
}
