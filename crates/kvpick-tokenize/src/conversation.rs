//! Request bodies read into template messages, reusing the messages of an earlier body that
//! shares a byte prefix (ARCHITECTURE.md §8, prefix cache). An agent resends its whole conversation every
//! turn, and clients serialize it the same way each time, so the new body starts with the bytes
//! of the previous one. Converting only the messages past that shared start keeps a turn's cost
//! proportional to its new text.
//!
//! It never reads a body's structure itself: the body's [`BodyLayout`] (recorded by the
//! streaming scanner while the body arrived, `crate::body::scan`) says where each top-level field
//! and each conversation item lies, and each value the prompt needs is decoded once from its
//! bytes. Exactness: JSON is read left to right, so the items lying wholly inside a byte-identical
//! prefix lie at the same offsets and decode to the same values; a cached body's converted items
//! are reused for them, and only when the new body's layout puts its first items exactly where
//! the cached body's were. This module owns that cache; it knows nothing about templates or
//! tokenizers.

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;
use parking_lot::Mutex;
use xxhash_rust::xxh3::Xxh3;

use super::body::layout::{decode, BodyLayout, Span, TopField};
use super::json::Json;
use super::prefix_cache::common_prefix;
use super::prompt::{ContentFormat, ConversationField, Endpoint, Message};

/// Bodies are indexed by the hash of every prefix of a multiple of this many bytes; bodies under
/// two strides are read whole (there is little to save).
pub const STRIDE: usize = 4096;

/// A body as the prompt reader needs it.
#[derive(Debug)]
pub struct ParsedBody {
    /// The top-level fields in order. The conversation field, when `items` is set, holds an
    /// empty list: its messages are in `items`.
    pub top: Json,
    /// The conversation field's items as template messages.
    pub items: Option<Vec<Arc<Message>>>,
    /// How many of `items` came from an earlier body.
    pub reused: usize,
}

/// Why a body could not be read (the request is then routed on load alone).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct BodyError(pub String);

/// A cached body: its bytes and where each conversation item lies.
struct CachedBody {
    body: Bytes,
    field: ConversationField,
    items_at: Vec<Span>,
    items: Vec<Arc<Message>>,
    format: ContentFormat,
    endpoint: Endpoint,
    keys: Vec<u64>,
    last_used: u64,
}

#[derive(Default)]
struct Inner {
    /// Prefix hash -> body id.
    map: HashMap<u64, u64>,
    bodies: HashMap<u64, CachedBody>,
    next_id: u64,
    clock: u64,
    bytes: usize,
}

/// Bounded LRU cache of read conversation bodies.
pub struct ConversationCache {
    inner: Mutex<Inner>,
    max_bytes: usize,
    stride: usize,
}

/// Cache statistics (for tests).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ConversationStats {
    pub bodies: usize,
    pub bytes: usize,
}

/// A body's conversation: which field, and where its items lie.
struct Conversation<'a> {
    field: ConversationField,
    items_at: &'a [Span],
}

impl ConversationCache {
    /// A cache holding bodies of at most `max_bytes` in all (the newest is always kept).
    pub fn new(max_bytes: usize) -> Self {
        Self::with_stride(max_bytes, STRIDE)
    }

    /// A cache indexing bodies every `stride` bytes (small strides let tests and the fuzzer
    /// reach the reuse with small bodies).
    pub fn with_stride(max_bytes: usize, stride: usize) -> Self {
        ConversationCache {
            inner: Mutex::new(Inner::default()),
            max_bytes,
            stride: stride.max(1),
        }
    }

    pub fn stats(&self) -> ConversationStats {
        let inner = self.inner.lock();
        ConversationStats {
            bodies: inner.bodies.len(),
            bytes: inner.bytes,
        }
    }

    /// Reads `body` (its layout found here: tools and tests; the host hands the scanner's to
    /// [`ConversationCache::read`]).
    pub fn parse(
        &self,
        body: &Bytes,
        endpoint: Endpoint,
        format: ContentFormat,
    ) -> Result<ParsedBody, BodyError> {
        let layout = BodyLayout::of(endpoint, body).map_err(BodyError)?;
        self.read(body, &layout, endpoint, format)
    }

    /// Reads `body` laid out as `layout`, reusing the messages of a cached body with the same
    /// start.
    pub fn read(
        &self,
        body: &Bytes,
        layout: &BodyLayout,
        endpoint: Endpoint,
        format: ContentFormat,
    ) -> Result<ParsedBody, BodyError> {
        let conversation = conversation_of(body, layout, endpoint);
        let Some(conversation) = conversation.filter(|_| body.len() >= 2 * self.stride) else {
            return read(body, layout, endpoint, format);
        };
        let keys = prefix_keys(body, self.stride);
        let hit = self.lookup(body, endpoint, format, &keys, &conversation);
        let (reused, replaces) = match hit {
            Some((id, items, whole)) => (items, whole.then_some(id)),
            None => (Vec::new(), None),
        };
        let from = reused.len();
        let mut items = reused;
        items.reserve(conversation.items_at.len() - from);
        for &at in &conversation.items_at[from..] {
            items.push(convert(body, at, conversation.field, format)?);
        }
        let parsed = ParsedBody {
            top: top_fields(body, layout, Some(conversation.field))?,
            items: Some(items.clone()),
            reused: from,
        };
        // A body that continues a cached one replaces it: an agent's earlier turns are not
        // asked for again.
        let cached = CachedBody {
            body: body.clone(),
            field: conversation.field,
            items_at: conversation.items_at.to_vec(),
            items,
            format,
            endpoint,
            keys,
            last_used: 0,
        };
        self.insert(cached, replaces);
        Ok(parsed)
    }

    /// The converted items of the cached body sharing the longest start with `body` that lie
    /// inside the shared bytes (at least one) and where `conversation` puts its own first items;
    /// with the cached body's id and whether every one of its items is reused.
    fn lookup(
        &self,
        body: &[u8],
        endpoint: Endpoint,
        format: ContentFormat,
        keys: &[u64],
        conversation: &Conversation<'_>,
    ) -> Option<(u64, Vec<Arc<Message>>, bool)> {
        let mut inner = self.inner.lock();
        inner.clock += 1;
        let now = inner.clock;
        for (i, key) in keys.iter().enumerate().rev() {
            let len = (i + 1) * self.stride;
            let Some(&id) = inner.map.get(key) else {
                continue;
            };
            let Some(cached) = inner.bodies.get_mut(&id) else {
                continue;
            };
            if cached.endpoint != endpoint
                || cached.format != format
                || cached.body.len() < len
                || cached.body[..len] != body[..len]
            {
                continue;
            }
            let shared = len + common_prefix(&cached.body[len..], &body[len..]);
            let reused = cached.items_at.partition_point(|at| at.end <= shared);
            if reused == 0
                || cached.field != conversation.field
                || conversation.items_at.get(..reused) != Some(&cached.items_at[..reused])
            {
                return None;
            }
            cached.last_used = now;
            let whole = reused == cached.items.len();
            return Some((id, cached.items[..reused].to_vec(), whole));
        }
        None
    }

    fn insert(&self, mut cached: CachedBody, replaces: Option<u64>) {
        let mut inner = self.inner.lock();
        if let Some(old) = replaces {
            inner.remove(old);
        }
        inner.clock += 1;
        let id = inner.next_id;
        inner.next_id += 1;
        for &key in &cached.keys {
            inner.map.insert(key, id);
        }
        inner.bytes += cached.body.len();
        cached.last_used = inner.clock;
        inner.bodies.insert(id, cached);
        while inner.bytes > self.max_bytes && inner.bodies.len() > 1 {
            let Some(oldest) = inner
                .bodies
                .iter()
                .filter(|(b, _)| **b != id)
                .min_by_key(|(_, b)| b.last_used)
                .map(|(b, _)| *b)
            else {
                break;
            };
            inner.remove(oldest);
        }
    }
}

impl Inner {
    fn remove(&mut self, id: u64) {
        if let Some(cached) = self.bodies.remove(&id) {
            self.bytes -= cached.body.len();
            for key in &cached.keys {
                if self.map.get(key) == Some(&id) {
                    self.map.remove(key);
                }
            }
        }
    }
}

/// Reads a body without the cache: its fields and, when it has one, its converted conversation.
pub fn read(
    body: &[u8],
    layout: &BodyLayout,
    endpoint: Endpoint,
    format: ContentFormat,
) -> Result<ParsedBody, BodyError> {
    let Some(conversation) = conversation_of(body, layout, endpoint) else {
        return Ok(ParsedBody {
            top: top_fields(body, layout, None)?,
            items: None,
            reused: 0,
        });
    };
    let items = conversation
        .items_at
        .iter()
        .map(|&at| convert(body, at, conversation.field, format))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(ParsedBody {
        top: top_fields(body, layout, Some(conversation.field))?,
        items: Some(items),
        reused: 0,
    })
}

/// The body's conversation, when it has exactly one conversation field and it is a list.
fn conversation_of<'a>(
    body: &[u8],
    layout: &'a BodyLayout,
    endpoint: Endpoint,
) -> Option<Conversation<'a>> {
    let is_list = |f: &TopField| body.get(f.value.start) == Some(&b'[');
    let input_is_list = layout.unique("input").is_some_and(is_list);
    let field = ConversationField::of(endpoint, |k| layout.has(k), input_is_list)?;
    // A repeated key: the plain reader decides which one counts.
    let found = layout.unique(field.key())?;
    Some(Conversation {
        field,
        items_at: found.items.as_deref()?,
    })
}

/// One conversation item as a template message.
fn convert(
    body: &[u8],
    at: Span,
    field: ConversationField,
    format: ContentFormat,
) -> Result<Arc<Message>, BodyError> {
    let json = decode(body, at).map_err(BodyError)?;
    let message = field
        .convert(&json, format)
        .map_err(|e| BodyError(e.to_string()))?;
    Ok(Message::new(message))
}

/// The body's top-level fields as values, the conversation field (if any) as an empty list.
fn top_fields(
    body: &[u8],
    layout: &BodyLayout,
    conversation: Option<ConversationField>,
) -> Result<Json, BodyError> {
    let mut fields = Vec::with_capacity(layout.fields.len());
    for f in &layout.fields {
        let value = if conversation.is_some_and(|c| c.key() == f.key) {
            Json::Array(Vec::new())
        } else {
            decode(body, f.value).map_err(|e| BodyError(format!("{}: {e}", f.key)))?
        };
        fields.push((f.key.clone(), value));
    }
    Ok(Json::Object(fields))
}

/// xxh3 of every `stride`-multiple prefix of `body`.
fn prefix_keys(body: &[u8], stride: usize) -> Vec<u64> {
    let mut hasher = Xxh3::new();
    body.chunks_exact(stride)
        .map(|chunk| {
            hasher.update(chunk);
            hasher.digest()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prompt::{prompt_spec_for, prompt_spec_parsed, PromptSpec};
    use rand::{rngs::StdRng, Rng, SeedableRng};
    use serde_json::json;

    fn message(rng: &mut StdRng, i: usize) -> serde_json::Value {
        let text: String = (0..rng.random_range(50..400))
            .map(|k| ["word ", "ünï ", "数据 ", "\n", "\"q\" ", "\\ ", "{}, "][(i + k) % 7])
            .collect();
        match rng.random_range(0..5) {
            0 => {
                json!({"role": "user", "content": [{"type": "text", "text": text}, {"type": "text", "text": "part"}]})
            }
            1 => {
                json!({"role": "assistant", "content": null, "tool_calls": [{"id": format!("c{i}"), "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]})
            }
            2 => json!({"role": "tool", "tool_call_id": format!("c{i}"), "content": text}),
            _ => {
                json!({"role": if i.is_multiple_of(2) { "user" } else { "assistant" }, "content": text})
            }
        }
    }

    fn item(rng: &mut StdRng, i: usize) -> serde_json::Value {
        match rng.random_range(0..3) {
            0 => {
                json!({"type": "function_call", "call_id": format!("c{i}"), "name": "f", "arguments": "{}"})
            }
            1 => {
                json!({"type": "function_call_output", "call_id": format!("c{i}"), "output": "x".repeat(300 * (i % 5))})
            }
            _ => json!({"role": "user", "content": "y".repeat(200 + i)}),
        }
    }

    /// A body as a client sends it: fields before and after the conversation, compact or pretty.
    fn body(
        conversation: &[serde_json::Value],
        responses: bool,
        pretty: bool,
        tail: &str,
    ) -> Bytes {
        let mut fields = serde_json::Map::new();
        fields.insert("model".into(), json!("m"));
        if responses {
            fields.insert("instructions".into(), json!("be brief"));
            fields.insert("input".into(), json!(conversation));
        } else {
            fields.insert("messages".into(), json!(conversation));
            fields.insert(
                "tools".into(),
                json!([{"type": "function", "function": {"name": "f"}}]),
            );
        }
        fields.insert("stream".into(), json!(true));
        fields.insert("user".into(), json!(tail));
        let value = serde_json::Value::Object(fields);
        let text = if pretty {
            serde_json::to_string_pretty(&value).unwrap()
        } else {
            serde_json::to_string(&value).unwrap()
        };
        Bytes::from(text)
    }

    fn plain_spec(body: &[u8]) -> Result<PromptSpec, String> {
        let json: Json = serde_json::from_slice(body).map_err(|e| e.to_string())?;
        prompt_spec_for(Endpoint::Generate, &json, ContentFormat::String).map_err(|e| e.to_string())
    }

    fn cached_spec(cache: &ConversationCache, body: &Bytes) -> Result<(PromptSpec, usize), String> {
        let parsed = cache
            .parse(body, Endpoint::Generate, ContentFormat::String)
            .map_err(|e| e.to_string())?;
        let spec = prompt_spec_parsed(
            Endpoint::Generate,
            &parsed.top,
            parsed.items,
            ContentFormat::String,
        )
        .map_err(|e| e.to_string())?;
        Ok((spec, parsed.reused))
    }

    /// Growing, edited and branching conversations in chat and responses bodies: the cached
    /// parse always equals parsing the whole body, and turns reuse the earlier messages.
    #[test]
    fn spliced_parse_equals_plain_parse() {
        let mut rng = StdRng::seed_from_u64(11);
        let cache = ConversationCache::new(4 << 20);
        let mut reused_turns = 0;
        for round in 0..12 {
            let responses = round % 3 == 2;
            let pretty = round % 4 == 1;
            let mut conversation: Vec<serde_json::Value> = Vec::new();
            let mut snapshots: Vec<Vec<serde_json::Value>> = Vec::new();
            for turn in 0..25 {
                match rng.random_range(0..10) {
                    // Edit a recent message.
                    0 if conversation.len() > 2 => {
                        let at = conversation.len() - rng.random_range(1..3);
                        conversation[at] = if responses {
                            item(&mut rng, turn + 1000)
                        } else {
                            message(&mut rng, turn + 1000)
                        };
                    }
                    // Change only the end of the last message.
                    2 if !conversation.is_empty() => {
                        let last = conversation.last_mut().unwrap();
                        let key = if last.get("output").is_some() {
                            "output"
                        } else {
                            "content"
                        };
                        if let Some(serde_json::Value::String(s)) = last.get_mut(key) {
                            // Same length when the last character is ASCII: only bytes change.
                            let was = s.pop();
                            s.push(if was == Some('!') { '?' } else { '!' });
                        } else {
                            last[key] = json!("!");
                        }
                    }
                    // Go back to an earlier turn (a retry or a branch).
                    1 if !snapshots.is_empty() => {
                        conversation = snapshots[rng.random_range(0..snapshots.len())].clone();
                    }
                    _ => {
                        for _ in 0..rng.random_range(1..3) {
                            let i = conversation.len();
                            conversation.push(if responses {
                                item(&mut rng, i)
                            } else {
                                message(&mut rng, i)
                            });
                        }
                    }
                }
                snapshots.push(conversation.clone());
                let tail = if rng.random_bool(0.2) {
                    "changed"
                } else {
                    "same"
                };
                let b = body(&conversation, responses, pretty, tail);
                let (spec, reused) = cached_spec(&cache, &b).unwrap();
                assert_eq!(spec, plain_spec(&b).unwrap(), "round {round} turn {turn}");
                if reused > 0 {
                    reused_turns += 1;
                }
            }
        }
        assert!(reused_turns > 80, "reused on {reused_turns} turns");
    }

    #[test]
    fn odd_bodies_take_the_plain_path_or_fail_like_it() {
        let cache = ConversationCache::new(1 << 20);
        let long = "z".repeat(3 * STRIDE);
        let first = format!(
            r#"{{"messages":[{{"role":"user","content":"{long}"}},{{"role":"user","content":"b"}}]}}"#
        );
        cached_spec(&cache, &Bytes::from(first.clone())).unwrap();
        // The same start, then broken JSON after the shared message.
        let broken =
            format!(r#"{{"messages":[{{"role":"user","content":"{long}"}} {{"role":"user"}}]}}"#);
        assert!(cached_spec(&cache, &Bytes::from(broken.clone())).is_err());
        assert!(plain_spec(broken.as_bytes()).is_err());
        let truncated = &first[..first.len() - 3];
        assert!(cached_spec(&cache, &Bytes::from(truncated.to_string())).is_err());
        // A second `messages` key: the plain reader's answer.
        let twice = format!(
            r#"{{"messages":[{{"role":"user","content":"{long}"}}],"messages":[{{"role":"user","content":"c"}}]}}"#
        );
        let (spec, reused) = cached_spec(&cache, &Bytes::from(twice.clone())).unwrap();
        assert_eq!(reused, 0);
        assert_eq!(spec, plain_spec(twice.as_bytes()).unwrap());
        // Unsupported content after a shared message fails as it does without the cache.
        let image = format!(
            r#"{{"messages":[{{"role":"user","content":"{long}"}},{{"role":"user","content":[{{"type":"input_audio","input_audio":{{"data":"x"}}}}]}}]}}"#
        );
        assert!(cached_spec(&cache, &Bytes::from(image.clone())).is_err());
        assert!(plain_spec(image.as_bytes()).is_err());
    }

    #[test]
    fn cache_stays_within_its_bound_and_replaces_continued_bodies() {
        let cache = ConversationCache::new(200_000);
        let mut conversation = vec![json!({"role": "system", "content": "s".repeat(9000)})];
        for i in 0..30 {
            conversation
                .push(json!({"role": "user", "content": format!("turn {i} {}", "t".repeat(3000))}));
            cached_spec(&cache, &body(&conversation, false, false, "same")).unwrap();
            // Each turn continues the last one, which it replaces.
            assert_eq!(cache.stats().bodies, 1);
        }
        for i in 0..40 {
            let other =
                vec![json!({"role": "user", "content": format!("{i} {}", "o".repeat(20_000))})];
            cached_spec(&cache, &body(&other, false, false, "same")).unwrap();
        }
        assert!(
            cache.stats().bytes <= 200_000 + 30_000,
            "{:?}",
            cache.stats()
        );
    }
}
#[cfg(test)]
mod edge_tests {
    use super::*;
    use crate::prompt::{prompt_spec_for, prompt_spec_parsed};

    fn both(body: &str) -> (Result<String, ()>, Result<String, ()>) {
        let cache = ConversationCache::with_stride(1 << 20, 8);
        let b = Bytes::from(body.to_string());
        let cached = cache
            .parse(&b, Endpoint::Generate, ContentFormat::String)
            .ok()
            .and_then(|p| {
                prompt_spec_parsed(Endpoint::Generate, &p.top, p.items, ContentFormat::String).ok()
            })
            .map(|s| format!("{s:?}"))
            .ok_or(());
        let plain = serde_json::from_slice::<Json>(body.as_bytes())
            .ok()
            .and_then(|j| prompt_spec_for(Endpoint::Generate, &j, ContentFormat::String).ok())
            .map(|s| format!("{s:?}"))
            .ok_or(());
        (cached, plain)
    }

    #[test]
    fn non_objects_and_deep_nesting_read_as_the_whole_body_reader_reads_them() {
        for body in ["[1, 2]", "\"text\"", "null", "7"] {
            let (cached, plain) = both(body);
            assert_eq!(cached, plain, "{body}");
        }
        // Around serde_json's limit, in an item and in a top-level field; brackets inside strings
        // do not count.
        for n in 120..=130 {
            let deep = format!(
                r#"{{"messages":[{{"role":"user","content":"x]]{{","extra":{}1{}}}],"z":{}2{}}}"#,
                "[".repeat(n),
                "]".repeat(n),
                "[".repeat(n + 1),
                "]".repeat(n + 1),
            );
            let (cached, plain) = both(&deep);
            assert_eq!(cached, plain, "{n}");
            let deep = format!(
                r#"{{"messages":[{{"role":"user","content":"\"[[","extra":{}1{}}}]}}"#,
                "[".repeat(n),
                "]".repeat(n)
            );
            let (cached, plain) = both(&deep);
            assert_eq!(cached, plain, "{n}");
        }
    }
}
