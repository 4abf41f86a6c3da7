//! Request bodies parsed into template messages, reusing the messages of an earlier body that
//! shares a byte prefix (ARCHITECTURE.md §8, prefix cache). An agent resends its whole conversation every
//! turn, and clients serialize it the same way each time, so the new body starts with the bytes
//! of the previous one. Parsing and converting only the messages past that shared start keeps a
//! turn's cost proportional to its new text.
//!
//! Exactness: JSON is parsed left to right, so items lying wholly inside a byte-identical prefix
//! parse to the same values. A body is split at an item boundary of a cached body inside the
//! shared prefix: the body's bytes up to its conversation array's `[` followed by the bytes
//! after that item (a *splice*) parse to exactly the same top-level fields and remaining items,
//! and the cached items go in front. Anything unusual (a second conversation key, no `,` or `]`
//! after the item) takes the plain path. This module owns that cache; it knows nothing about
//! templates or tokenizers.

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;
use parking_lot::Mutex;
use serde::de::{Deserializer, MapAccess, Visitor};
use serde_json::value::RawValue;
use xxhash_rust::xxh3::Xxh3;

use super::json::Json;
use super::prefix_cache::common_prefix;
use super::prompt::{ContentFormat, ConversationField, Endpoint, Message};

/// Bodies are indexed by the hash of every prefix of a multiple of this many bytes; bodies under
/// two strides are parsed whole (there is little to save).
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

/// A cached body: its bytes and where each conversation item ends.
struct CachedBody {
    body: Bytes,
    field: ConversationField,
    /// Offset just past the conversation array's `[`.
    array_open: usize,
    /// Offset just past each item.
    item_ends: Vec<usize>,
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

/// Bounded LRU cache of parsed conversation bodies.
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

impl ConversationCache {
    /// A cache holding bodies of at most `max_bytes` in all (the newest is always kept).
    pub fn new(max_bytes: usize) -> Self {
        Self::with_stride(max_bytes, STRIDE)
    }

    /// A cache indexing bodies every `stride` bytes (small strides let tests and the fuzzer
    /// reach the splice with small bodies).
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

    /// Parses `body`, reusing the messages of a cached body with the same start.
    pub fn parse(
        &self,
        body: &Bytes,
        endpoint: Endpoint,
        format: ContentFormat,
    ) -> Result<ParsedBody, BodyError> {
        if body.len() < 2 * self.stride {
            return Ok(parse_plain(body, endpoint, format)?.0);
        }
        let keys = prefix_keys(body, self.stride);
        if let Some(parsed) = self.parse_spliced(body, endpoint, format, &keys)? {
            return Ok(parsed);
        }
        let (parsed, layout) = parse_plain(body, endpoint, format)?;
        if let (Some(layout), Some(items)) = (layout, &parsed.items) {
            self.insert(body, endpoint, format, layout, items.clone(), keys, None);
        }
        Ok(parsed)
    }

    /// The spliced parse when a cached body shares at least one whole item with `body`.
    fn parse_spliced(
        &self,
        body: &Bytes,
        endpoint: Endpoint,
        format: ContentFormat,
        keys: &[u64],
    ) -> Result<Option<ParsedBody>, BodyError> {
        let Some(hit) = self.lookup(body, endpoint, format, keys) else {
            return Ok(None);
        };
        let Hit {
            id,
            field,
            array_open,
            item_ends,
            items,
            whole,
        } = hit;
        let reused = items.len();
        let after = item_ends[reused - 1];
        let mut at = after;
        while at < body.len() && matches!(body[at], b' ' | b'\t' | b'\n' | b'\r') {
            at += 1;
        }
        let rest = match body.get(at) {
            Some(b',') => at + 1,
            Some(b']') => at,
            _ => return Ok(None),
        };
        let mut splice = Vec::with_capacity(array_open + body.len() - rest);
        splice.extend_from_slice(&body[..array_open]);
        splice.extend_from_slice(&body[rest..]);
        let Ok(envelope) = parse_envelope(&splice) else {
            // Let the plain parse report the error for the body as sent.
            return Ok(None);
        };
        let Some(conversation) = read_conversation(&envelope, endpoint, &splice, format)? else {
            return Ok(None);
        };
        if conversation.field != field || conversation.array_open != array_open {
            return Ok(None);
        }
        // Splice offsets past the `[` are body offsets shifted by what was cut out.
        let shift = rest - array_open;
        let mut all_ends = item_ends;
        all_ends.extend(conversation.item_ends.iter().map(|e| e + shift));
        let mut all_items = items;
        all_items.extend(conversation.items);
        let top = top_fields(&envelope, Some(field))?;
        let parsed = ParsedBody {
            top,
            items: Some(all_items.clone()),
            reused,
        };
        let layout = Layout {
            field,
            array_open,
            item_ends: all_ends,
        };
        // A body that continues a cached one replaces it: an agent's earlier turns are not
        // asked for again.
        let replaces = whole.then_some(id);
        self.insert(
            body,
            endpoint,
            format,
            layout,
            all_items,
            keys.to_vec(),
            replaces,
        );
        Ok(Some(parsed))
    }

    /// The cached body sharing the longest start with `body`, cut to the items inside the
    /// shared bytes (at least one).
    fn lookup(
        &self,
        body: &[u8],
        endpoint: Endpoint,
        format: ContentFormat,
        keys: &[u64],
    ) -> Option<Hit> {
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
            let reused = cached.item_ends.partition_point(|&end| end <= shared);
            if reused == 0 {
                return None;
            }
            cached.last_used = now;
            return Some(Hit {
                id,
                field: cached.field,
                array_open: cached.array_open,
                item_ends: cached.item_ends[..reused].to_vec(),
                items: cached.items[..reused].to_vec(),
                whole: reused == cached.items.len(),
            });
        }
        None
    }

    #[allow(clippy::too_many_arguments)]
    fn insert(
        &self,
        body: &Bytes,
        endpoint: Endpoint,
        format: ContentFormat,
        layout: Layout,
        items: Vec<Arc<Message>>,
        keys: Vec<u64>,
        replaces: Option<u64>,
    ) {
        let mut inner = self.inner.lock();
        if let Some(old) = replaces {
            inner.remove(old);
        }
        inner.clock += 1;
        let id = inner.next_id;
        inner.next_id += 1;
        for &key in &keys {
            inner.map.insert(key, id);
        }
        inner.bytes += body.len();
        let last_used = inner.clock;
        inner.bodies.insert(
            id,
            CachedBody {
                body: body.clone(),
                field: layout.field,
                array_open: layout.array_open,
                item_ends: layout.item_ends,
                items,
                format,
                endpoint,
                keys,
                last_used,
            },
        );
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

struct Hit {
    id: u64,
    field: ConversationField,
    array_open: usize,
    item_ends: Vec<usize>,
    items: Vec<Arc<Message>>,
    /// Every item of the cached body is reused.
    whole: bool,
}

/// Where a body's conversation sits.
struct Layout {
    field: ConversationField,
    array_open: usize,
    item_ends: Vec<usize>,
}

/// The whole-body parse: fields, converted items and (for caching) where the items are.
fn parse_plain(
    body: &[u8],
    endpoint: Endpoint,
    format: ContentFormat,
) -> Result<(ParsedBody, Option<Layout>), BodyError> {
    let envelope = match parse_envelope(body) {
        Ok(envelope) => envelope,
        // Not an object: whatever the whole-body reader makes of it (no conversation).
        Err(e) => {
            let top: Json = serde_json::from_slice(body).map_err(|_| BodyError(e.to_string()))?;
            let parsed = ParsedBody {
                top,
                items: None,
                reused: 0,
            };
            return Ok((parsed, None));
        }
    };
    match read_conversation(&envelope, endpoint, body, format)? {
        Some(conversation) => Ok((
            ParsedBody {
                top: top_fields(&envelope, Some(conversation.field))?,
                items: Some(conversation.items),
                reused: 0,
            },
            Some(Layout {
                field: conversation.field,
                array_open: conversation.array_open,
                item_ends: conversation.item_ends,
            }),
        )),
        None => Ok((
            ParsedBody {
                top: top_fields(&envelope, None)?,
                items: None,
                reused: 0,
            },
            None,
        )),
    }
}

/// A body's top-level fields, in order, each still as its JSON text.
type Envelope<'a> = Vec<(String, &'a RawValue)>;

fn parse_envelope(body: &[u8]) -> Result<Envelope<'_>, serde_json::Error> {
    struct EnvelopeVisitor;
    impl<'de> Visitor<'de> for EnvelopeVisitor {
        type Value = Envelope<'de>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a JSON object")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Envelope<'de>, A::Error> {
            let mut fields = Vec::new();
            while let Some(entry) = map.next_entry::<String, &'de RawValue>()? {
                fields.push(entry);
            }
            Ok(fields)
        }
    }
    let mut de = serde_json::Deserializer::from_slice(body);
    let fields = (&mut de).deserialize_map(EnvelopeVisitor)?;
    de.end()?;
    Ok(fields)
}

struct Conversation {
    field: ConversationField,
    array_open: usize,
    item_ends: Vec<usize>,
    items: Vec<Arc<Message>>,
}

/// The conversation items of an envelope parsed from `buf`, when the body has exactly one
/// conversation field and it is a list.
fn read_conversation(
    envelope: &Envelope<'_>,
    endpoint: Endpoint,
    buf: &[u8],
    format: ContentFormat,
) -> Result<Option<Conversation>, BodyError> {
    let has = |key: &str| envelope.iter().any(|(k, _)| k == key);
    let raw_of = |key: &str| {
        let mut found = envelope.iter().filter(|(k, _)| k == key).map(|(_, v)| *v);
        match (found.next(), found.next()) {
            (Some(v), None) => Some(v),
            _ => None,
        }
    };
    let input_is_list = raw_of("input").is_some_and(|v| v.get().starts_with('['));
    let Some(field) = ConversationField::of(endpoint, has, input_is_list) else {
        return Ok(None);
    };
    // A repeated key: the plain reader decides which one counts.
    let Some(raw) = raw_of(field.key()) else {
        return Ok(None);
    };
    if !raw.get().starts_with('[') {
        return Ok(None);
    }
    let list: Vec<&RawValue> =
        serde_json::from_str(raw.get()).map_err(|e| BodyError(format!("{}: {e}", field.key())))?;
    let base = buf.as_ptr() as usize;
    let array_open = raw.get().as_ptr() as usize - base + 1;
    let mut item_ends = Vec::with_capacity(list.len());
    let mut items = Vec::with_capacity(list.len());
    for item in list {
        item_ends.push(item.get().as_ptr() as usize - base + item.get().len());
        // Items sit two levels down (object, list): keep the whole-body reader's depth limit.
        check_depth(item.get(), 2)?;
        let json: Json = serde_json::from_str(item.get()).map_err(|e| BodyError(format!("{e}")))?;
        let message = field
            .convert(&json, format)
            .map_err(|e| BodyError(e.to_string()))?;
        items.push(Message::new(message));
    }
    Ok(Some(Conversation {
        field,
        array_open,
        item_ends,
        items,
    }))
}

/// The envelope's fields as values, the conversation field (if any) as an empty list.
fn top_fields(
    envelope: &Envelope<'_>,
    conversation: Option<ConversationField>,
) -> Result<Json, BodyError> {
    let mut fields = Vec::with_capacity(envelope.len());
    for (key, raw) in envelope {
        let value = if conversation.is_some_and(|f| f.key() == key) {
            Json::Array(Vec::new())
        } else {
            check_depth(raw.get(), 1)?;
            serde_json::from_str(raw.get()).map_err(|e| BodyError(format!("{key}: {e}")))?
        };
        fields.push((key.clone(), value));
    }
    Ok(Json::Object(fields))
}

/// serde_json's nesting limit for a whole document.
const MAX_DEPTH: usize = 127;

/// Fails like the whole-body parse would when `raw` (valid JSON found `above` levels down in the
/// body) nests deeper than the limit counted from the body's top.
fn check_depth(raw: &str, above: usize) -> Result<(), BodyError> {
    let (mut depth, mut deepest, mut in_string, mut escaped) = (0usize, 0usize, false, false);
    for &b in raw.as_bytes() {
        if in_string {
            match (escaped, b) {
                (true, _) => escaped = false,
                (false, b'\\') => escaped = true,
                (false, b'"') => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                deepest = deepest.max(depth);
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    if deepest + above > MAX_DEPTH {
        return Err(BodyError("recursion limit exceeded".into()));
    }
    Ok(())
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
