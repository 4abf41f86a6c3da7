//! Where a request body's parts lie: every top-level field (its key, where its value starts and
//! ends) and, for the fields that may hold a conversation (`messages`, `input`), where each item
//! of the list lies. The streaming scanner ([`super::scan`]) records it while it reads the body
//! for routing, so the tokenizer decodes only the values the chat template needs, each once, and
//! never reads the body's structure again ([`crate::conversation`] reuses an earlier body's items
//! by it). A body the scanner does not settle gets its layout from serde instead
//! ([`BodyLayout::from_serde`]), as its routing fields come from serde; `BodyLayout::of` (in
//! [`super::scan`], which records layouts: this module never names the scanner) picks.
//!
//! It owns the layout and the decoding of one part into [`Json`]; it knows no API's fields
//! beyond which keys may hold a conversation.

// Offsets and depths are bounded by the body's length.
#![allow(clippy::arithmetic_side_effects)]

use serde::de::{Deserializer, MapAccess, Visitor};
use serde_json::value::RawValue;

use super::Endpoint;
use crate::json::Json;

/// Byte offsets `start..end` of a JSON value in the body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    pub start: usize,
    pub end: usize,
}

/// One top-level field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopField {
    pub key: String,
    pub value: Span,
    /// The items of a list under a conversation key (`messages`, `input`), in order.
    pub items: Option<Vec<Span>>,
}

/// A body's top-level fields in the order sent (a repeated key appears twice).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BodyLayout {
    pub fields: Vec<TopField>,
}

/// Whether a top-level key may hold a conversation list ([`crate::prompt::ConversationField`];
/// only chat, completions and responses bodies have one).
pub fn is_conversation_key(key: &[u8]) -> bool {
    key == b"messages" || key == b"input"
}

/// serde_json's nesting limit for a whole document.
const SERDE_MAX_DEPTH: usize = 127;

impl BodyLayout {
    /// The layout as serde reads the body (the scanner's fallback, and its oracle in tests and
    /// fuzzing: equal whenever the scanner gives one): a body that is JSON but not an object has
    /// no fields; nesting past serde's limit anywhere is the error serde gives.
    pub fn from_serde(endpoint: Endpoint, body: &[u8]) -> Result<Self, String> {
        let fields = match envelope(body) {
            Ok(fields) => fields,
            Err(e) => {
                // Not an object: valid JSON has no fields, anything else is the error. Parsed as
                // the whole-body parse does, not skipped: serde_json skips an ignored string's
                // bytes without checking their UTF-8 and an ignored number without its range
                // (`88e886`), both of which the whole-body parse rejects (found by the
                // conversation_body fuzz). A rare path: bodies are objects.
                let valid = serde_json::from_slice::<Json>(body).is_ok();
                return if valid {
                    Ok(BodyLayout::default())
                } else {
                    Err(e.to_string())
                };
            }
        };
        let base = body.as_ptr() as usize;
        let span_of = |raw: &RawValue| {
            let start = raw.get().as_ptr() as usize - base;
            Span {
                start,
                end: start + raw.get().len(),
            }
        };
        let mut out = Vec::with_capacity(fields.len());
        for (key, raw) in fields {
            // Values sit one level down (items two): fail as the whole-body parse would.
            check_depth(raw.get(), 1)?;
            let conversation =
                endpoint == Endpoint::Generate && is_conversation_key(key.as_bytes());
            let items = if conversation && raw.get().starts_with('[') {
                let list: Vec<&RawValue> =
                    serde_json::from_str(raw.get()).map_err(|e| format!("{key}: {e}"))?;
                Some(list.into_iter().map(span_of).collect())
            } else {
                None
            };
            out.push(TopField {
                key,
                value: span_of(raw),
                items,
            });
        }
        Ok(BodyLayout { fields: out })
    }

    /// The field under `key`, when the body has exactly one.
    pub fn unique(&self, key: &str) -> Option<&TopField> {
        let mut found = self.fields.iter().filter(|f| f.key == key);
        match (found.next(), found.next()) {
            (Some(f), None) => Some(f),
            _ => None,
        }
    }

    pub fn has(&self, key: &str) -> bool {
        self.fields.iter().any(|f| f.key == key)
    }
}

/// One part of the body as a value (`span` comes from the body's layout, so it is valid JSON).
pub fn decode(body: &[u8], span: Span) -> Result<Json, String> {
    let raw = body
        .get(span.start..span.end)
        .ok_or("span out of the body")?;
    serde_json::from_slice(raw).map_err(|e| e.to_string())
}

/// A body's top-level fields, in order, each still as its JSON text.
fn envelope(body: &[u8]) -> Result<Vec<(String, &RawValue)>, serde_json::Error> {
    struct EnvelopeVisitor;
    impl<'de> Visitor<'de> for EnvelopeVisitor {
        type Value = Vec<(String, &'de RawValue)>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a JSON object")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
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

/// Fails like the whole-body parse would when `raw` (valid JSON found `above` levels down in the
/// body) nests deeper than serde's limit counted from the body's top.
fn check_depth(raw: &str, above: usize) -> Result<(), String> {
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
    if deepest + above > SERDE_MAX_DEPTH {
        return Err("recursion limit exceeded".into());
    }
    Ok(())
}

/// The top-level fields of a body named in `keys`, decoded (in the body's order).
pub(crate) fn fields_of(body: &[u8], layout: &BodyLayout, keys: &[&str]) -> Result<Json, String> {
    let mut out = Vec::new();
    for f in layout
        .fields
        .iter()
        .filter(|f| keys.contains(&f.key.as_str()))
    {
        out.push((f.key.clone(), decode(body, f.value)?));
    }
    Ok(Json::Object(out))
}

#[cfg(test)]
#[path = "layout_tests.rs"]
mod tests;
