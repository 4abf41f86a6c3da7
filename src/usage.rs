//! Extracts `usage` (prompt, completion and cached prompt tokens) from OpenAI responses, JSON or
//! SSE, fed chunk by chunk as they stream past. Never holds more than a bounded amount of the
//! response and never delays a chunk: it only observes.

#![warn(clippy::arithmetic_side_effects)]

use serde::Deserialize;

/// Token counts an engine reported for one response.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    /// 0 when the engine did not report it.
    pub cached_tokens: u64,
    /// The engine reported `prompt_tokens_details.cached_tokens` (vLLM only does with
    /// `--enable-prompt-tokens-details`): a 0 then means nothing was cached, not "unknown".
    pub cached_reported: bool,
}

#[derive(Deserialize)]
struct WithUsage {
    #[serde(default)]
    usage: Option<RawUsage>,
}

#[derive(Deserialize)]
struct RawUsage {
    #[serde(default)]
    prompt_tokens: Option<u64>,
    #[serde(default)]
    completion_tokens: Option<u64>,
    #[serde(default)]
    prompt_tokens_details: Option<Details>,
}

#[derive(Deserialize)]
struct Details {
    #[serde(default)]
    cached_tokens: Option<u64>,
}

fn usage_of(json: &[u8]) -> Option<Usage> {
    let parsed: WithUsage = serde_json::from_slice(json).ok()?;
    let raw = parsed.usage?;
    let cached = raw.prompt_tokens_details.and_then(|d| d.cached_tokens);
    Some(Usage {
        prompt_tokens: raw.prompt_tokens.unwrap_or(0),
        completion_tokens: raw.completion_tokens.unwrap_or(0),
        cached_tokens: cached.unwrap_or(0),
        cached_reported: cached.is_some(),
    })
}

/// Longest SSE line or JSON body we keep to look for usage; longer ones are skipped.
const MAX_KEPT: usize = 4 << 20;

/// Incremental usage extraction over a response body.
#[derive(Debug)]
pub struct UsageTracker {
    sse: bool,
    pending: Vec<u8>,
    overflowed: bool,
    usage: Option<Usage>,
}

impl UsageTracker {
    pub fn new(sse: bool) -> Self {
        UsageTracker {
            sse,
            pending: Vec::new(),
            overflowed: false,
            usage: None,
        }
    }

    /// Observes one body chunk.
    pub fn feed(&mut self, chunk: &[u8]) {
        if !self.sse {
            if self.overflowed || self.pending.len().saturating_add(chunk.len()) > MAX_KEPT {
                self.overflowed = true;
                self.pending = Vec::new();
            } else {
                self.pending.extend_from_slice(chunk);
            }
            return;
        }
        let mut rest = chunk;
        while let Some(nl) = memchr(b'\n', rest) {
            let (head, tail) = rest.split_at(nl);
            if self.overflowed {
                self.overflowed = false;
            } else if self.pending.is_empty() {
                self.sse_line(head);
            } else {
                let mut line = std::mem::take(&mut self.pending);
                line.extend_from_slice(head);
                self.sse_line(&line);
            }
            rest = &tail[1..];
        }
        if !rest.is_empty() && !self.overflowed {
            if self.pending.len().saturating_add(rest.len()) > MAX_KEPT {
                self.overflowed = true;
                self.pending = Vec::new();
            } else {
                self.pending.extend_from_slice(rest);
            }
        }
    }

    fn sse_line(&mut self, line: &[u8]) {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let Some(data) = line.strip_prefix(b"data:") else {
            return;
        };
        let data = data.trim_ascii();
        if data.first() != Some(&b'{') || !contains(data, b"\"usage\"") {
            return;
        }
        if let Some(u) = usage_of(data) {
            self.usage = Some(u);
        }
    }

    /// The usage seen, once the body has ended.
    pub fn finish(&mut self) -> Option<Usage> {
        if self.sse {
            if !self.pending.is_empty() && !self.overflowed {
                let line = std::mem::take(&mut self.pending);
                self.sse_line(&line);
            }
        } else if !self.overflowed && !self.pending.is_empty() {
            self.usage = usage_of(&self.pending);
            self.pending = Vec::new();
        }
        self.usage
    }
}

fn memchr(needle: u8, haystack: &[u8]) -> Option<usize> {
    haystack.iter().position(|&b| b == needle)
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

#[cfg(test)]
#[allow(clippy::arithmetic_side_effects)]
mod tests {
    use super::*;

    const SSE: &[u8] = b"data: {\"choices\":[{\"text\":\"a\"}]}\n\n\
data: {\"choices\":[],\"usage\":{\"prompt_tokens\":100,\"completion_tokens\":7,\"prompt_tokens_details\":{\"cached_tokens\":64}}}\n\n\
data: [DONE]\n\n";

    #[test]
    fn sse_usage_split_at_every_byte() {
        let expected = Usage {
            prompt_tokens: 100,
            completion_tokens: 7,
            cached_tokens: 64,
            cached_reported: true,
        };
        for split in 0..SSE.len() {
            let mut t = UsageTracker::new(true);
            t.feed(&SSE[..split]);
            t.feed(&SSE[split..]);
            assert_eq!(t.finish(), Some(expected), "split at {split}");
        }
        // One byte at a time, with CRLF line ends.
        let crlf: Vec<u8> = String::from_utf8_lossy(SSE)
            .replace('\n', "\r\n")
            .into_bytes();
        let mut t = UsageTracker::new(true);
        for b in &crlf {
            t.feed(std::slice::from_ref(b));
        }
        assert_eq!(t.finish(), Some(expected));
    }

    #[test]
    fn json_usage_without_details() {
        let body = br#"{"id":"x","usage":{"prompt_tokens":5,"completion_tokens":2}}"#;
        let mut t = UsageTracker::new(false);
        t.feed(&body[..10]);
        t.feed(&body[10..]);
        assert_eq!(
            t.finish(),
            Some(Usage {
                prompt_tokens: 5,
                completion_tokens: 2,
                cached_tokens: 0,
                cached_reported: false,
            }),
            "no details: the cached count is unknown, not 0"
        );
    }

    #[test]
    fn no_usage_and_garbage() {
        let mut t = UsageTracker::new(true);
        t.feed(b"data: {\"usage\": nope}\n\nevent: x\n");
        assert_eq!(t.finish(), None);
        let mut t = UsageTracker::new(false);
        t.feed(b"\xff\xfe");
        assert_eq!(t.finish(), None);
    }
}
