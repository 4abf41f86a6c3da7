//! The replay's flow-control report: per priority band (TTFT including the wait in kvpick's
//! queue, SLO attainment, refusals by status, throughput) and per tenant (share of the output).
//! Only for traces with flow-control columns ([`super::trace::FlowClass`]); owns nothing else.

use std::collections::BTreeMap;

use serde::Serialize;

use super::{stat, Outcome, Prepared, Stat};

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct BandReport {
    pub priority: i32,
    pub requests: u64,
    pub completed: u64,
    /// Refused with 429 (shed: sheddable timeouts, SLOs that cannot be met, full sheddable band).
    pub refused_429: u64,
    /// Refused with 503 (no capacity within the queue timeout).
    pub refused_503: u64,
    /// Arrival to first token, completed requests.
    pub ttft_ms: Stat,
    /// Output tokens per second of this band over the makespan.
    pub throughput_tok_s: f64,
    /// Requests of the band with a TTFT SLO, and the share of them served within it (a refused
    /// one counts as missed).
    pub slo_requests: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slo_attainment: Option<f64>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct TenantReport {
    pub tenant: String,
    pub requests: u64,
    pub completed: u64,
    pub refused: u64,
    pub throughput_tok_s: f64,
    /// This tenant's share of its priority band's output tokens.
    pub band_output_share: f64,
    /// Its share of the band's work (prompt tokens) served while every tenant of the band still
    /// had requests to serve: up to the earliest tenant's last first token. Fair queuing gives
    /// equal shares there, whatever the tenants' rates.
    pub backlogged_work_share: f64,
    pub ttft_ms: Stat,
}

fn classified(requests: &[Prepared]) -> bool {
    requests
        .iter()
        .any(|r| r.class.priority.is_some() || r.class.slo_ttft_ms.is_some())
}

fn ttft_ms(o: &Outcome, r: &Prepared) -> Option<f64> {
    o.first_ns
        .filter(|_| o.done_ns.is_some() && !o.refused)
        .map(|f| (f.saturating_sub(r.arrival_ns)) as f64 / 1e6)
}

pub(super) fn bands(
    outcomes: &[Outcome],
    requests: &[Prepared],
    makespan_ns: u64,
) -> Vec<BandReport> {
    if !classified(requests) {
        return Vec::new();
    }
    let span_s = makespan_ns.max(1) as f64 / 1e9;
    let mut by_band: BTreeMap<i32, Vec<(&Outcome, &Prepared)>> = BTreeMap::new();
    for (o, r) in outcomes.iter().zip(requests) {
        by_band
            .entry(r.class.priority.unwrap_or(0))
            .or_default()
            .push((o, r));
    }
    by_band
        .into_iter()
        .rev()
        .map(|(priority, members)| {
            let mut ttft: Vec<f64> = members.iter().filter_map(|(o, r)| ttft_ms(o, r)).collect();
            let status = |code| {
                members
                    .iter()
                    .filter(|(o, _)| o.status == Some(code))
                    .count()
            };
            let output: u64 = members
                .iter()
                .filter(|(o, _)| !o.refused && o.done_ns.is_some())
                .map(|(o, _)| o.output)
                .sum();
            let with_slo: Vec<_> = members
                .iter()
                .filter_map(|(o, r)| r.class.slo_ttft_ms.map(|slo| (o, r, slo)))
                .collect();
            let met = with_slo
                .iter()
                .filter(|(o, r, slo)| ttft_ms(o, r).is_some_and(|t| t <= *slo as f64))
                .count();
            BandReport {
                priority,
                requests: members.len() as u64,
                completed: ttft.len() as u64,
                refused_429: status(429) as u64,
                refused_503: status(503) as u64,
                ttft_ms: stat(&mut ttft),
                throughput_tok_s: output as f64 / span_s,
                slo_requests: with_slo.len() as u64,
                slo_attainment: (!with_slo.is_empty()).then(|| met as f64 / with_slo.len() as f64),
            }
        })
        .collect()
}

pub(super) fn tenants(
    outcomes: &[Outcome],
    requests: &[Prepared],
    makespan_ns: u64,
) -> Vec<TenantReport> {
    if !requests.iter().any(|r| r.class.tenant.is_some()) {
        return Vec::new();
    }
    let span_s = makespan_ns.max(1) as f64 / 1e9;
    let served = |o: &Outcome| !o.refused && o.done_ns.is_some();
    let mut band_output: BTreeMap<i32, u64> = BTreeMap::new();
    let mut by_tenant: BTreeMap<(String, i32), Vec<(&Outcome, &Prepared)>> = BTreeMap::new();
    for (o, r) in outcomes.iter().zip(requests) {
        let band = r.class.priority.unwrap_or(0);
        if served(o) {
            *band_output.entry(band).or_default() += o.output;
        }
        let tenant = r.class.tenant.clone().unwrap_or_default();
        by_tenant.entry((tenant, band)).or_default().push((o, r));
    }
    // Per band: the end of the window in which every tenant still had requests to serve.
    let mut window_end: BTreeMap<i32, u64> = BTreeMap::new();
    for ((_, band), members) in &by_tenant {
        let last = members
            .iter()
            .filter(|(o, _)| served(o))
            .filter_map(|(o, _)| o.first_ns)
            .max()
            .unwrap_or(0);
        let end = window_end.entry(*band).or_insert(u64::MAX);
        *end = (*end).min(last);
    }
    let in_window = |o: &Outcome, band: i32| {
        served(o)
            && o.first_ns
                .is_some_and(|f| f <= window_end.get(&band).copied().unwrap_or(0))
    };
    let mut window_work: BTreeMap<i32, u64> = BTreeMap::new();
    for ((_, band), members) in &by_tenant {
        *window_work.entry(*band).or_default() += members
            .iter()
            .filter(|(o, _)| in_window(o, *band))
            .map(|(o, _)| o.prompt)
            .sum::<u64>();
    }
    by_tenant
        .into_iter()
        .map(|((tenant, band), members)| {
            let work: u64 = members
                .iter()
                .filter(|(o, _)| in_window(o, band))
                .map(|(o, _)| o.prompt)
                .sum();
            let mut ttft: Vec<f64> = members.iter().filter_map(|(o, r)| ttft_ms(o, r)).collect();
            let output: u64 = members
                .iter()
                .filter(|(o, _)| served(o))
                .map(|(o, _)| o.output)
                .sum();
            let band_total = band_output.get(&band).copied().unwrap_or(0).max(1);
            TenantReport {
                tenant,
                requests: members.len() as u64,
                completed: ttft.len() as u64,
                refused: members.iter().filter(|(o, _)| o.refused).count() as u64,
                throughput_tok_s: output as f64 / span_s,
                band_output_share: output as f64 / band_total as f64,
                backlogged_work_share: work as f64
                    / window_work.get(&band).copied().unwrap_or(0).max(1) as f64,
                ttft_ms: stat(&mut ttft),
            }
        })
        .collect()
}
