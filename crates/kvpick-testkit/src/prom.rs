//! Just enough of the Prometheus text format to read kvpick's own `/metrics`: samples by name
//! and labels, sums across series, histogram buckets, and quantiles between two scrapes
//! (linear inside a bucket, as `histogram_quantile` does).
//!
//! Pure values over a page already fetched.

use std::collections::BTreeMap;

/// One sample line: name, labels, value.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

/// Every sample of a page (comments and unreadable lines skipped).
pub fn parse(text: &str) -> Vec<Sample> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(parse_line)
        .collect()
}

fn parse_line(line: &str) -> Option<Sample> {
    let (series, value) = line.rsplit_once(' ')?;
    let value = match value.trim() {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse().ok()?,
    };
    let (name, labels) = match series.split_once('{') {
        None => (series.trim(), BTreeMap::new()),
        Some((name, rest)) => (name, parse_labels(rest.strip_suffix('}')?)?),
    };
    Some(Sample {
        name: name.to_string(),
        labels,
        value,
    })
}

fn parse_labels(text: &str) -> Option<BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    let mut rest = text;
    while !rest.is_empty() {
        let (key, after) = rest.split_once("=\"")?;
        let mut value = String::new();
        let mut chars = after.char_indices();
        let end = loop {
            let (i, c) = chars.next()?;
            match c {
                '\\' => value.push(chars.next()?.1),
                '"' => break i,
                c => value.push(c),
            }
        };
        out.insert(key.trim_start_matches(',').to_string(), value);
        rest = after[end + 1..].trim_start_matches(',');
    }
    Some(out)
}

/// The sum of every series named `name` whose labels include `filter`.
pub fn sum(samples: &[Sample], name: &str, filter: &[(&str, &str)]) -> f64 {
    samples
        .iter()
        .filter(|s| s.name == name && matches(s, filter))
        .map(|s| s.value)
        .sum()
}

fn matches(sample: &Sample, filter: &[(&str, &str)]) -> bool {
    filter
        .iter()
        .all(|(k, v)| sample.labels.get(*k).is_some_and(|l| l == v))
}

/// A histogram's cumulative buckets `(le, count)`, summed over every series of `name` (the
/// `_bucket` suffix added here), in `le` order.
pub fn buckets(samples: &[Sample], name: &str) -> Vec<(f64, f64)> {
    let bucket = format!("{name}_bucket");
    let mut by_le: BTreeMap<u64, (f64, f64)> = BTreeMap::new();
    for s in samples.iter().filter(|s| s.name == bucket) {
        let Some(le) = s.labels.get("le").and_then(|le| match le.as_str() {
            "+Inf" => Some(f64::INFINITY),
            v => v.parse::<f64>().ok(),
        }) else {
            continue;
        };
        // Non-negative floats order like their bit patterns.
        let entry = by_le.entry(le.to_bits()).or_insert((le, 0.0));
        entry.1 += s.value;
    }
    by_le.into_values().collect()
}

/// What a histogram counted between two scrapes: `after` minus `before`, bucket by bucket.
pub fn delta(before: &[(f64, f64)], after: &[(f64, f64)]) -> Vec<(f64, f64)> {
    after
        .iter()
        .map(|&(le, count)| {
            let old = before
                .iter()
                .find(|(l, _)| *l == le)
                .map_or(0.0, |(_, c)| *c);
            (le, (count - old).max(0.0))
        })
        .collect()
}

/// The `q` quantile of cumulative `buckets`, linear within its bucket (the lowest bucket starts
/// at 0); `None` when nothing was counted. A quantile in the `+Inf` bucket is the highest finite
/// bound (a floor, as Prometheus reports it).
pub fn quantile(buckets: &[(f64, f64)], q: f64) -> Option<f64> {
    let total = buckets.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = q * total;
    let mut lower = (0.0, 0.0);
    for &(le, count) in buckets {
        if count >= rank {
            if le.is_infinite() {
                return Some(lower.0);
            }
            let width = count - lower.1;
            let share = if width > 0.0 {
                (rank - lower.1) / width
            } else {
                1.0
            };
            return Some(lower.0 + (le - lower.0) * share);
        }
        lower = (le, count);
    }
    Some(lower.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: &str = "# HELP h help\n# TYPE h histogram\n\
        h_bucket{le=\"0.001\"} 10\nh_bucket{le=\"0.01\"} 90\nh_bucket{le=\"+Inf\"} 100\n\
        h_sum 0.5\nh_count 100\n\
        c_total{result=\"applied\",x=\"a \\\"q\\\"\"} 7\nc_total{result=\"dropped\"} 2\ng 3\n";

    #[test]
    fn samples_labels_sums_and_quantiles() {
        let samples = parse(PAGE);
        assert_eq!(sum(&samples, "c_total", &[]), 9.0);
        assert_eq!(sum(&samples, "c_total", &[("result", "applied")]), 7.0);
        assert_eq!(sum(&samples, "g", &[]), 3.0);
        let quoted = samples.iter().find(|s| s.labels.contains_key("x")).unwrap();
        assert_eq!(quoted.labels["x"], "a \"q\"");
        let h = buckets(&samples, "h");
        assert_eq!(h.len(), 3);
        assert_eq!(
            quantile(&h, 0.05),
            Some(0.0005),
            "half way into the first bucket"
        );
        let p50 = quantile(&h, 0.5).unwrap();
        assert!((p50 - 0.0055).abs() < 1e-9, "{p50}");
        assert_eq!(
            quantile(&h, 0.99),
            Some(0.01),
            "in +Inf: the highest finite bound"
        );
    }

    #[test]
    fn a_delta_counts_only_what_came_between() {
        let before = vec![(0.001, 5.0), (f64::INFINITY, 5.0)];
        let after = vec![(0.001, 5.0), (f64::INFINITY, 15.0)];
        let d = delta(&before, &after);
        assert_eq!(d, vec![(0.001, 0.0), (f64::INFINITY, 10.0)]);
        assert_eq!(quantile(&delta(&after, &after), 0.5), None);
    }
}
