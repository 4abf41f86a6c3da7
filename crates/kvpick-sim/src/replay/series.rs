//! What the replay loop records for the HTML report ([`crate::charts`]): in-flight requests per
//! rank and the policy's queue length, after each virtual instant, and the CDFs at the end. It
//! only observes: it is handed values the loop already has and returns nothing the loop reads.

use super::policy::Policy;
use crate::charts::{self, PolicyCharts, StepRecorder};

pub(super) struct Observer {
    in_flight: Vec<u32>,
    load: StepRecorder,
    queue: StepRecorder,
}

impl Observer {
    pub(super) fn new(workers: usize) -> Self {
        Observer {
            in_flight: vec![0; workers],
            load: StepRecorder::default(),
            queue: StepRecorder::default(),
        }
    }

    /// A request entered `rank`'s engine.
    pub(super) fn dispatched(&mut self, rank: usize) {
        self.in_flight[rank] += 1;
    }

    /// A request on `rank` finished.
    pub(super) fn finished(&mut self, rank: usize) {
        self.in_flight[rank] = self.in_flight[rank].saturating_sub(1);
    }

    /// The loop is done with instant `now_ns`.
    pub(super) fn after_instant(&mut self, now_ns: u64, policy: &dyn Policy) {
        self.load.record(now_ns, &self.in_flight);
        if let Some(q) = policy.queued() {
            self.queue
                .record(now_ns, &[u32::try_from(q).unwrap_or(u32::MAX)]);
        }
    }

    /// The policy's charts over `[start_ns, end_ns]`.
    pub(super) fn charts(
        &self,
        policy: &dyn Policy,
        ttft_ms: &[f64],
        e2e_ms: &[f64],
        kv_hit_rate: f64,
        requests_per_rank: &[u64],
        (start_ns, end_ns): (u64, u64),
    ) -> PolicyCharts {
        let sample = |r: &StepRecorder, channels| {
            r.sample(channels, start_ns, end_ns, charts::SERIES_SAMPLES)
        };
        PolicyCharts {
            name: policy.name().to_string(),
            ttft_cdf: charts::cdf(ttft_ms, charts::CDF_POINTS),
            e2e_cdf: charts::cdf(e2e_ms, charts::CDF_POINTS),
            kv_hit_rate,
            requests_per_rank: requests_per_rank.to_vec(),
            load: Some(sample(&self.load, self.in_flight.len())),
            queue: policy.queued().map(|_| sample(&self.queue, 1)),
        }
    }
}
