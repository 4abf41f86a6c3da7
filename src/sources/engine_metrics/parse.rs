//! A small strict reader of the Prometheus text exposition format (version 0.0.4), for the few
//! series kvpick takes from an engine's `/metrics`. Lines of other metrics are skipped after
//! reading their name, so a large page (vLLM's histograms) costs one scan; a wanted line must be
//! well-formed (`name{label="value",...} value [timestamp]`) or the whole page is refused.
//!
//! Owns text -> samples only; what a sample means is [`super::reading`]'s business.

use std::borrow::Cow;

/// One sample of a wanted metric.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample<'a> {
    pub name: &'a str,
    pub labels: Vec<(&'a str, Cow<'a, str>)>,
    pub value: f64,
}

impl Sample<'_> {
    pub fn label(&self, name: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.as_ref())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: {what}")]
pub struct ParseError {
    pub line: usize,
    pub what: String,
}

fn is_name_start(b: u8) -> bool {
    b.is_ascii_alphabetic() || b == b'_' || b == b':'
}

fn is_name_char(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_' || b == b':'
}

/// Calls `each` for every sample whose metric name is in `wanted`, in page order.
pub fn samples<'a>(
    text: &'a str,
    wanted: &[&str],
    mut each: impl FnMut(Sample<'a>),
) -> Result<(), ParseError> {
    for (i, raw) in text.split('\n').enumerate() {
        let line = raw.strip_suffix('\r').unwrap_or(raw).trim_start();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let err = |what: &str| ParseError {
            line: i + 1,
            what: what.to_string(),
        };
        let bytes = line.as_bytes();
        if !is_name_start(bytes[0]) {
            return Err(err("a sample line must start with a metric name"));
        }
        let name_end = bytes
            .iter()
            .position(|&b| !is_name_char(b))
            .unwrap_or(bytes.len());
        let name = &line[..name_end];
        if !wanted.contains(&name) {
            continue;
        }
        let (labels, rest) = match bytes.get(name_end) {
            Some(b'{') => labels(&line[name_end + 1..]).map_err(|what| err(&what))?,
            _ => (Vec::new(), &line[name_end..]),
        };
        if !rest.starts_with([' ', '\t']) {
            return Err(err("expected whitespace before the value"));
        }
        let mut fields = rest.split_ascii_whitespace();
        let value = fields
            .next()
            .ok_or_else(|| err("missing value"))
            .and_then(|v| parse_value(v).ok_or_else(|| err(&format!("bad value {v:?}"))))?;
        if let Some(ts) = fields.next() {
            if ts.parse::<i64>().is_err() {
                return Err(err(&format!("bad timestamp {ts:?}")));
            }
        }
        if fields.next().is_some() {
            return Err(err("trailing text after the timestamp"));
        }
        each(Sample {
            name,
            labels,
            value,
        });
    }
    Ok(())
}

fn parse_value(v: &str) -> Option<f64> {
    match v {
        "NaN" => Some(f64::NAN),
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        _ => v.parse::<f64>().ok(),
    }
}

type Labels<'a> = Vec<(&'a str, Cow<'a, str>)>;

/// Reads `name="value",...}` (after the `{`); returns the labels and the text after `}`.
fn labels(mut s: &str) -> Result<(Labels<'_>, &str), String> {
    let mut out = Vec::new();
    loop {
        s = s.trim_start();
        if let Some(rest) = s.strip_prefix('}') {
            return Ok((out, rest));
        }
        let b = s.as_bytes();
        if b.is_empty() || !(b[0].is_ascii_alphabetic() || b[0] == b'_') {
            return Err("expected a label name".into());
        }
        let end = b
            .iter()
            .position(|&c| !(c.is_ascii_alphanumeric() || c == b'_'))
            .unwrap_or(b.len());
        let name = &s[..end];
        s = s[end..].trim_start();
        s = s
            .strip_prefix('=')
            .ok_or_else(|| format!("expected '=' after label {name}"))?
            .trim_start();
        s = s
            .strip_prefix('"')
            .ok_or_else(|| format!("expected '\"' to open label {name}'s value"))?;
        let (value, rest) =
            label_value(s).ok_or_else(|| format!("unterminated value of {name}"))?;
        out.push((name, value));
        s = rest.trim_start();
        if let Some(rest) = s.strip_prefix(',') {
            s = rest;
        } else if !s.starts_with('}') {
            return Err("expected ',' or '}' after a label".into());
        }
    }
}

/// A label value up to its closing quote, unescaping `\\`, `\"` and `\n`.
fn label_value(s: &str) -> Option<(Cow<'_, str>, &str)> {
    let b = s.as_bytes();
    let mut i = 0;
    let mut owned: Option<String> = None;
    while i < b.len() {
        match b[i] {
            b'"' => {
                let value = match owned {
                    Some(o) => Cow::Owned(o),
                    None => Cow::Borrowed(&s[..i]),
                };
                return Some((value, &s[i + 1..]));
            }
            b'\\' => {
                let o = owned.get_or_insert_with(|| s[..i].to_string());
                match b.get(i + 1)? {
                    b'\\' => o.push('\\'),
                    b'"' => o.push('"'),
                    b'n' => o.push('\n'),
                    _ => return None,
                }
                i += 2;
            }
            _ => {
                // Copy a whole UTF-8 character.
                let ch = s[i..].chars().next()?;
                if let Some(o) = owned.as_mut() {
                    o.push(ch);
                }
                i += ch.len_utf8();
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;
    use rand::{Rng, SeedableRng};

    fn all<'a>(text: &'a str, wanted: &[&str]) -> Result<Vec<Sample<'a>>, ParseError> {
        let mut out = Vec::new();
        samples(text, wanted, |s| out.push(s))?;
        Ok(out)
    }

    const VLLM: &str = r#"# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25 1700000000000
vllm:e2e_request_latency_seconds_bucket{le="+Inf",model_name="m"} 12.0
vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql,chat",waiting_lora_adapters=""} 1.7e9
"#;

    #[test]
    fn reads_wanted_series_with_labels_values_and_timestamps() {
        let got = all(
            VLLM,
            &[
                "vllm:num_requests_waiting",
                "vllm:kv_cache_usage_perc",
                "vllm:lora_requests_info",
            ],
        )
        .unwrap();
        assert_eq!(got.len(), 4);
        assert_eq!(got[0].label("engine"), Some("0"));
        assert_eq!(got[0].value, 3.0);
        assert_eq!(got[2].value, 0.25);
        assert_eq!(got[3].label("running_lora_adapters"), Some("sql,chat"));
        assert_eq!(got[3].label("waiting_lora_adapters"), Some(""));
        assert_eq!(got[3].value, 1.7e9);
    }

    #[test]
    fn escapes_spaces_and_special_values() {
        let text = "m{a=\"x\\\"y\\\\z\\n\" , b = \"é\",} +Inf\nm NaN\nm -Inf\r\n";
        let got = all(text, &["m"]).unwrap();
        assert_eq!(got[0].label("a"), Some("x\"y\\z\n"));
        assert_eq!(got[0].label("b"), Some("é"));
        assert_eq!(got[0].value, f64::INFINITY);
        assert!(got[1].value.is_nan());
        assert_eq!(got[2].value, f64::NEG_INFINITY);
    }

    #[test]
    fn malformed_wanted_lines_are_refused_and_unwanted_ones_skipped() {
        for bad in [
            "m{a=\"1\" 2",
            "m{a=1} 2",
            "m{a=\"1\"}2",
            "m{a=\"1\"} x",
            "m 1 notatimestamp",
            "m 1 2 3",
            "m",
            "m{a=\"\\q\"} 1",
            "m{=\"1\"} 1",
            "{a=\"1\"} 1",
        ] {
            assert!(all(bad, &["m"]).is_err(), "{bad:?} must be refused");
        }
        // Not wanted: its syntax is not our business.
        assert_eq!(all("other{oops 1\nm 2\n", &["m"]).unwrap().len(), 1);
        // A longer name sharing the prefix is another metric.
        assert!(all("m_total 1\n", &["m"]).unwrap().is_empty());
    }

    /// Fuzz-style: random bytes and random mutations of a valid page never panic, and whatever
    /// parses re-reads to the same samples.
    #[test]
    fn random_input_never_panics() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(17);
        let alphabet = b"m{}=\",\\ \t\n\r#0123456789.eE+-abInfNa:_\xc3\xa9";
        for _ in 0..20_000 {
            let len = rng.random_range(0..64);
            let bytes: Vec<u8> = (0..len)
                .map(|_| alphabet[rng.random_range(0..alphabet.len())])
                .collect();
            let text = String::from_utf8_lossy(&bytes);
            let _ = all(&text, &["m", "a"]);
        }
        for _ in 0..5_000 {
            let mut bytes = VLLM.as_bytes().to_vec();
            for _ in 0..rng.random_range(1..4) {
                let at = rng.random_range(0..bytes.len());
                bytes[at] = alphabet[rng.random_range(0..alphabet.len())];
            }
            let text = String::from_utf8_lossy(&bytes);
            let _ = all(
                &text,
                &["vllm:num_requests_waiting", "vllm:lora_requests_info"],
            );
        }
    }
}
