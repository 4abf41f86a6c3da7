//! `serve`'s outlier-detection flags (ARCHITECTURE.md §3b), moved out of `server` to keep that
//! file small. Owns the flags only; `server::config::outlier_config` checks them and the core's
//! `outlier` module does the detection.

use clap::Args;

/// When a rank is ejected from picks, and for how long.
#[derive(Debug, Clone, Args)]
pub struct OutlierArgs {
    /// Outlier detection: this many consecutive 5xx responses (or connect failures / timeouts,
    /// which Envoy answers 503/504) eject a rank from picks; 0 = off. kvpick's picks bypass
    /// Envoy's own outlier detection, so it does Envoy's job for them.
    #[arg(
        long,
        default_value_t = 5,
        value_name = "N",
        help_heading = "Outlier detection"
    )]
    pub outlier_consecutive_5xx: u32,

    /// The first ejection's length; the n-th lasts n times as long (shorter again after as long
    /// healthy). After it, one request probes the rank: success returns it, failure ejects again.
    #[arg(
        long,
        default_value_t = 30.0,
        value_name = "SECONDS",
        help_heading = "Outlier detection"
    )]
    pub outlier_base_ejection_secs: f64,

    /// Longest ejection.
    #[arg(
        long,
        default_value_t = 300.0,
        value_name = "SECONDS",
        help_heading = "Outlier detection"
    )]
    pub outlier_max_ejection_secs: f64,

    /// Most ranks of one model ejected at once, in percent (rounded down): past it failing ranks
    /// keep serving (a failing rank may answer; no rank never does).
    #[arg(
        long,
        default_value_t = 50,
        value_name = "PERCENT",
        help_heading = "Outlier detection"
    )]
    pub outlier_max_ejected_percent: u32,
}
