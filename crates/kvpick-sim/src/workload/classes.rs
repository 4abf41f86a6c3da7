//! Flow-control classes for generated traces (`kvpick workload --priority-mix --tenant-mix
//! --slo-ttft`): each request group (a session, a document's readers, a family) draws one
//! priority and one tenant, seeded and independent of the family's own draws, so the same seed
//! gives the same trace with or without classes. Owns the spec parsing and the assignment only.

use std::collections::HashMap;

use crate::replay::trace::{splitmix64, TraceRecord};

/// `NAME:WEIGHT,...` (weights > 0).
pub fn parse_weights<T: std::str::FromStr>(
    spec: &str,
    what: &str,
) -> anyhow::Result<Vec<(T, f64)>> {
    let mut out = Vec::new();
    for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (name, weight) = part
            .rsplit_once(':')
            .ok_or_else(|| anyhow::anyhow!("{what}: `{part}` is not NAME:WEIGHT"))?;
        let value = name
            .trim()
            .parse::<T>()
            .map_err(|_| anyhow::anyhow!("{what}: `{name}` is not valid"))?;
        let weight: f64 = weight
            .trim()
            .parse()
            .map_err(|_| anyhow::anyhow!("{what}: weight `{weight}` is not a number"))?;
        anyhow::ensure!(
            weight.is_finite() && weight > 0.0,
            "{what}: weight of `{name}` must be > 0"
        );
        out.push((value, weight));
    }
    anyhow::ensure!(!out.is_empty(), "{what}: empty");
    Ok(out)
}

/// Picks from `choices` by weight with `u` in [0, 1).
fn draw<T: Clone>(choices: &[(T, f64)], u: f64) -> T {
    let total: f64 = choices.iter().map(|(_, w)| w).sum();
    let mut at = u * total;
    for (value, weight) in choices {
        if at < *weight {
            return value.clone();
        }
        at -= weight;
    }
    choices[choices.len() - 1].0.clone()
}

fn unit(seed: u64, group: u64, stream: u64) -> f64 {
    let z = splitmix64(seed ^ splitmix64(group ^ stream.rotate_left(32)));
    (z >> 11) as f64 / (1u64 << 53) as f64
}

/// What to assign.
#[derive(Debug, Clone, Default)]
pub struct ClassSpec {
    pub priorities: Option<Vec<(i32, f64)>>,
    pub tenants: Option<Vec<(String, f64)>>,
    /// TTFT SLO (ms) of the requests of a priority.
    pub slo_ttft_ms: HashMap<i32, u64>,
}

impl ClassSpec {
    pub fn parse(
        priority_mix: Option<&str>,
        tenant_mix: Option<&str>,
        slo_ttft: Option<&str>,
    ) -> anyhow::Result<Self> {
        let mut slo = HashMap::new();
        if let Some(spec) = slo_ttft {
            for (priority, ms) in parse_weights::<i32>(spec, "--slo-ttft")? {
                slo.insert(priority, ms.round() as u64);
            }
        }
        Ok(ClassSpec {
            priorities: priority_mix
                .map(|s| parse_weights(s, "--priority-mix"))
                .transpose()?,
            tenants: tenant_mix
                .map(|s| parse_weights(s, "--tenant-mix"))
                .transpose()?,
            slo_ttft_ms: slo,
        })
    }

    pub fn is_empty(&self) -> bool {
        self.priorities.is_none() && self.tenants.is_none() && self.slo_ttft_ms.is_empty()
    }

    /// Sets each record's class from its group.
    pub fn assign(&self, records: &mut [TraceRecord], groups: &[u64], seed: u64) {
        for (record, group) in records.iter_mut().zip(groups) {
            let priority = self
                .priorities
                .as_ref()
                .map(|p| draw(p, unit(seed, *group, 1)));
            record.class.priority = priority;
            record.class.tenant = self
                .tenants
                .as_ref()
                .map(|t| draw(t, unit(seed, *group, 2)));
            record.class.slo_ttft_ms = self.slo_ttft_ms.get(&priority.unwrap_or(0)).copied();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn records(n: usize) -> Vec<TraceRecord> {
        (0..n)
            .map(|i| TraceRecord {
                timestamp: i as u64,
                input_length: 1,
                output_length: 1,
                hash_ids: vec![i as u64],
                class: Default::default(),
                session: Default::default(),
            })
            .collect()
    }

    #[test]
    fn classes_follow_the_weights_per_group_and_are_seeded() {
        let spec =
            ClassSpec::parse(Some("5:0.2,0:0.5,-1:0.3"), Some("a:4,b:1"), Some("5:2000")).unwrap();
        let n = 20_000;
        let groups: Vec<u64> = (0..n as u64).collect();
        let mut rs = records(n);
        spec.assign(&mut rs, &groups, 7);
        let share =
            |p: i32| rs.iter().filter(|r| r.class.priority == Some(p)).count() as f64 / n as f64;
        assert!((share(5) - 0.2).abs() < 0.02, "{}", share(5));
        assert!((share(-1) - 0.3).abs() < 0.02);
        let a = rs
            .iter()
            .filter(|r| r.class.tenant.as_deref() == Some("a"))
            .count() as f64;
        assert!((a / n as f64 - 0.8).abs() < 0.02);
        assert!(rs
            .iter()
            .all(|r| (r.class.priority == Some(5)) == (r.class.slo_ttft_ms == Some(2000))));
        // One group, one class.
        let mut same = records(3);
        spec.assign(&mut same, &[9, 9, 9], 7);
        assert!(same.windows(2).all(|w| w[0].class == w[1].class));
        let mut again = records(n);
        spec.assign(&mut again, &groups, 7);
        assert_eq!(rs, again);
    }

    #[test]
    fn bad_specs_are_clear_errors() {
        for bad in ["5", "x:1", "5:0", "5:-1", ""] {
            assert!(ClassSpec::parse(Some(bad), None, None).is_err(), "{bad}");
        }
    }
}
