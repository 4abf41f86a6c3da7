//! Bookings the core stopped believing (ARCHITECTURE.md §3, "Held bookings"): prefills decayed
//! past their expected time without a first byte, and bookings reconciled with an engine that
//! did not show them. Only records the core's facts; the bounds are the core's.

// Static metric definitions: an error is a programming error every test run hits at start-up.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use prometheus::{IntCounter, Registry};

/// The two counters of held bookings.
#[derive(Clone)]
pub struct BookingBoundMetrics {
    /// Bookings whose prefill stopped counting toward their rank's load (no first byte within
    /// their expected prefill time).
    pub decayed: IntCounter,
    /// Bookings taken off their rank's load because its engine did not show them.
    pub reconciled: IntCounter,
}

impl BookingBoundMetrics {
    pub fn register(registry: &Registry) -> Self {
        let decayed = IntCounter::new(
            "kvpick_bookings_decayed_total",
            "Bookings whose prefill stopped counting toward saturation: no first byte within \
             max(predicted TTFT x --booking-prefill-margin, --booking-prefill-floor-ms)",
        )
        .unwrap();
        let reconciled = IntCounter::new(
            "kvpick_bookings_reconciled_total",
            "Bookings taken off their rank's load: the engine's running + waiting requests \
             stayed below the booked ones for --booking-reconcile-after-ms",
        )
        .unwrap();
        registry.register(Box::new(decayed.clone())).unwrap();
        registry.register(Box::new(reconciled.clone())).unwrap();
        BookingBoundMetrics {
            decayed,
            reconciled,
        }
    }
}
