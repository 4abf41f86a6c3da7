//! Media parts of chat bodies (images) as vLLM identifies them for its prefix cache
//! (docs/tokenization.md "Images", docs/kv-events.md "Multimodal"): each image's identifier
//! (vLLM's `mm_hash`, or the client's `uuid`), the model's placeholder tokens for it, and the span
//! those tokens occupy in the prompt, which the core folds into the keys of the blocks they
//! occupy (`kvpick_core::hash::media_prompt_hashes`) the way vLLM's `extra_keys` fold them.
//!
//! Owns: finding image parts in OpenAI chat (`image_url`), Responses (`input_image`) and Anthropic
//! (`image` with a `base64` or `url` source) bodies in the order vLLM's chat parser meets them;
//! the identifier recipe (`MultiModalHasher.hash_kwargs("blake3", model_id=..., image=...)` over
//! a data URL's decoded bytes, hashed while the base64 text is decoded, a few KiB at a time, never
//! kept whole); the model's image token and count per image (`MediaConfig`, from the model
//! directory); the placeholder expansion after tokenization. It never renders templates or
//! tokenizes (that is `local`), and never selects anything.

use std::path::Path;

use kvpick_core::hash::{media_id, MediaSpan};

use super::endpoint::Endpoint;
use super::json::Json;

/// What the chat conversion writes for an image part in `string` content format, in place of the
/// model's placeholder string (which the conversion does not know); replaced by
/// [`MediaConfig::placeholder`] before tokenizing. Noncharacters: no client text holds them.
pub const IMAGE_SENTINEL: &str = "\u{FDD0}kvpick:image\u{FDD1}";

/// Identifiers of images kvpick cannot reproduce start with this, so they never equal a
/// vLLM identifier (a blake3 hex digest or a client uuid of another shape).
const APPROX_PREFIX: &str = "kvpick-approx:";

/// Most placeholder tokens the images of one prompt may add (4 MiB of token ids, the default body
/// budget): a body of many tiny image parts must not grow into a prompt far larger than itself.
/// Over it the prompt routes on load alone (no engine serves such a prompt anyway).
pub const MAX_IMAGE_TOKENS: usize = 1 << 20;

/// Decoded bytes hashed per step: the only buffer an image costs.
const DECODE_CHUNK: usize = 3 * 1024;

/// One model's multimodal layout, from its directory (`config.json`, `processor_config.json`,
/// `preprocessor_config.json`) and its entry's overrides.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MediaConfig {
    /// The image placeholder token id (`image_token_index` / `image_token_id`).
    pub image_token: u32,
    /// Its text, which vLLM's `string` content format puts in front of a message's text once per
    /// image (LLaVA: `<image>`).
    pub placeholder: String,
    /// Placeholder tokens per image after the processor's expansion.
    pub tokens_per_image: u32,
    /// vLLM's `model_config.model` (the `--model` the engine was started with), which its image
    /// hashes include.
    pub model_id: String,
}

/// An image as kvpick identifies it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MediaItem {
    /// vLLM's identifier when `exact`, else an approximation ([`APPROX_PREFIX`]).
    pub identifier: String,
    /// True when this is the identifier vLLM computes for the same part.
    pub exact: bool,
}

impl MediaConfig {
    /// The layout a model directory gives, if any: the image token from `config.json`, its text
    /// from the tokenizer (`id_to_token`), the count from `image_seq_length` / `num_image_tokens`
    /// (processor or preprocessor config), `mm_tokens_per_image` (config), or a fixed-resolution
    /// vision tower's patches (`vision_config.image_size / patch_size` squared, plus the CLS token
    /// when `vision_feature_select_strategy` is `full`; LLaVA-1.5: 576). `None` when any is missing.
    pub fn from_dir(
        dir: &Path,
        token_text: impl Fn(u32) -> Option<String>,
        model_id: &str,
    ) -> Option<MediaConfig> {
        let read = |name: &str| -> Option<serde_json::Value> {
            let text = std::fs::read_to_string(dir.join(name)).ok()?;
            serde_json::from_str(&text).ok()
        };
        let config = read("config.json")?;
        let processor = read("processor_config.json");
        let preprocessor = read("preprocessor_config.json");
        let u = |v: Option<&serde_json::Value>| v.and_then(serde_json::Value::as_u64);
        let image_token = u(config.get("image_token_index")).or(u(config.get("image_token_id")))?;
        let image_token = u32::try_from(image_token).ok()?;
        let count = [&processor, &preprocessor]
            .into_iter()
            .flatten()
            .find_map(|p| u(p.get("image_seq_length")).or(u(p.get("num_image_tokens"))))
            .or(u(config.get("mm_tokens_per_image")))
            .or(u(config.get("image_seq_length")))
            .or_else(|| patches(&config))?;
        Some(MediaConfig {
            image_token,
            placeholder: token_text(image_token)?,
            tokens_per_image: u32::try_from(count).ok().filter(|&c| c > 0)?,
            model_id: model_id.to_string(),
        })
    }
}

/// A fixed-resolution vision tower's patch count (LLaVA-style `vision_config`).
fn patches(config: &serde_json::Value) -> Option<u64> {
    let vision = config.get("vision_config")?;
    let size = vision.get("image_size")?.as_u64()?;
    let patch = vision.get("patch_size")?.as_u64()?.max(1);
    let side = size.checked_div(patch)?;
    let full = config
        .get("vision_feature_select_strategy")
        .and_then(serde_json::Value::as_str)
        == Some("full");
    side.checked_mul(side)?.checked_add(u64::from(full))
}

/// The top-level fields [`items`] reads (the tokenizer decodes only these for it).
pub const BODY_FIELDS: &[&str] = &[
    "messages",
    "input",
    "mm_processor_kwargs",
    "media_io_kwargs",
];

/// Every image of a body, in the order vLLM's chat parser meets them (messages in order, parts in
/// order). Parts kvpick does not read (audio, video, embeddings) are refused by the conversion
/// before this runs. `mm_processor_kwargs` in the body changes vLLM's hash in a way kvpick does not
/// reproduce: its images are then identified approximately.
pub fn items(endpoint: Endpoint, body: &Json, model_id: &str) -> Vec<MediaItem> {
    let kwargs = matches!(body.get("mm_processor_kwargs"), Some(Json::Object(e)) if !e.is_empty())
        || matches!(body.get("media_io_kwargs"), Some(Json::Object(e)) if !e.is_empty());
    let mut out = Vec::new();
    let conversation = match endpoint {
        Endpoint::Messages => body.get("messages"),
        _ => body.get("messages").or_else(|| body.get("input")),
    };
    for message in conversation.and_then(Json::as_array).unwrap_or_default() {
        let parts = message
            .get("content")
            .and_then(Json::as_array)
            .unwrap_or_default();
        let found: Vec<MediaItem> = match endpoint {
            Endpoint::Messages => anthropic_message(message, parts, model_id),
            _ => parts
                .iter()
                .filter_map(|p| openai_item(p, model_id))
                .collect(),
        };
        for mut item in found {
            if kwargs && item.exact {
                item = approximate(item.identifier.as_bytes());
            }
            out.push(item);
        }
    }
    out
}

/// One Anthropic message's images in the order vLLM's conversion emits them: a user turn's
/// `tool_result` images first (each result's tool message is followed by a user message of its
/// images, and all of them precede the turn's own message), then the message's `image` blocks.
/// System messages hold none (their text moves to the front).
fn anthropic_message(message: &Json, blocks: &[Json], model_id: &str) -> Vec<MediaItem> {
    let role = message.get("role").and_then(Json::as_str);
    if role == Some("system") {
        return Vec::new();
    }
    let mut out = Vec::new();
    if role != Some("assistant") {
        for block in blocks {
            if block.get("type").and_then(Json::as_str) != Some("tool_result") {
                continue;
            }
            let results = block
                .get("content")
                .and_then(Json::as_array)
                .unwrap_or_default();
            out.extend(results.iter().filter_map(|b| anthropic_item(b, model_id)));
        }
    }
    out.extend(blocks.iter().filter_map(|b| anthropic_item(b, model_id)));
    out
}

/// An OpenAI chat `image_url` part (`{"image_url": {"url"}}` or a bare string) or a Responses
/// `input_image` part (`{"image_url": "..."}`), with its optional `uuid`.
pub fn openai_item(part: &Json, model_id: &str) -> Option<MediaItem> {
    let uuid = uuid_of(part);
    if !is_image_part(part) {
        return None;
    }
    let url = match part.get("image_url") {
        Some(Json::String(url)) => Some(url.as_str()),
        Some(v @ Json::Object(_)) => v.get("url").and_then(Json::as_str),
        _ => None,
    };
    Some(identify(url, uuid.as_deref(), model_id))
}

/// An Anthropic `image` block: vLLM turns a `base64` source into the data URL
/// `data:{media_type};base64,{data}` (`media_type` defaulting to `image/jpeg`) and passes a `url`
/// source's URL as is. An image block without a source is dropped, as vLLM drops it.
pub fn anthropic_item(block: &Json, model_id: &str) -> Option<MediaItem> {
    if block.get("type").and_then(Json::as_str) != Some("image") {
        return None;
    }
    let source = block
        .get("source")
        .filter(|s| matches!(s, Json::Object(e) if !e.is_empty()))?;
    if source.get("type").and_then(Json::as_str) == Some("url") {
        return Some(identify(
            source.get("url").and_then(Json::as_str),
            None,
            model_id,
        ));
    }
    let media_type = source
        .get("media_type")
        .and_then(Json::as_str)
        .unwrap_or("image/jpeg");
    let data = source.get("data").and_then(Json::as_str).unwrap_or("");
    Some(match base64_identifier(data, model_id) {
        Ok(id) => MediaItem {
            identifier: id,
            exact: true,
        },
        Err(_) => approximate_parts(&[media_type.as_bytes(), data.as_bytes()]),
    })
}

/// A part's `uuid` as vLLM reads it (`str(uuid)`): a string as is, a number as its text.
fn uuid_of(part: &Json) -> Option<String> {
    match part.get("uuid")? {
        Json::String(s) => Some(s.clone()),
        Json::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

/// The identifier of an image given by URL (and maybe a client uuid): the uuid itself, the
/// hash of a base64 data URL's bytes, or an approximation (an `http(s)` URL, whose bytes vLLM
/// fetches and kvpick does not; a malformed or non-base64 data URL, which vLLM refuses).
pub fn identify(url: Option<&str>, uuid: Option<&str>, model_id: &str) -> MediaItem {
    if let Some(uuid) = uuid {
        return MediaItem {
            identifier: uuid.to_string(),
            exact: true,
        };
    }
    let url = url.unwrap_or("");
    match data_url_identifier(url, model_id) {
        Ok(id) => MediaItem {
            identifier: id,
            exact: true,
        },
        Err(_) => approximate(url.as_bytes()),
    }
}

fn approximate(bytes: &[u8]) -> MediaItem {
    approximate_parts(&[bytes])
}

fn approximate_parts(parts: &[&[u8]]) -> MediaItem {
    let mut h = blake3::Hasher::new();
    for p in parts {
        h.update(&(p.len() as u64).to_le_bytes());
        h.update(p);
    }
    MediaItem {
        identifier: format!("{APPROX_PREFIX}{}", h.finalize().to_hex()),
        exact: false,
    }
}

/// Why a data URL has no exact identifier.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MediaError {
    #[error("not a data URL")]
    NotDataUrl,
    #[error("data URL without ','")]
    NoComma,
    #[error("data URL not base64-encoded")]
    NotBase64,
    #[error("invalid base64")]
    BadBase64,
}

/// vLLM's identifier of an image sent as a `data:` URL (`MediaConnector._load_data_url`: the
/// spec before the first `,`, its last `;`-part must be `base64`; the bytes decoded strictly, as
/// `pybase64.b64decode(validate=True)`).
pub fn data_url_identifier(url: &str, model_id: &str) -> Result<String, MediaError> {
    let rest = url.strip_prefix("data:").ok_or(MediaError::NotDataUrl)?;
    let (spec, data) = rest.split_once(',').ok_or(MediaError::NoComma)?;
    match spec.rsplit_once(';') {
        Some((_, "base64")) => base64_identifier(data, model_id),
        _ => Err(MediaError::NotBase64),
    }
}

/// `MultiModalHasher.hash_kwargs("blake3", model_id=model_id, image=MediaWithBytes)` for the
/// bytes `data` encodes: kwargs in key order, each `len8(key) key` then the value tagged leaf
/// (`0x03`); the image value is `iter_item_to_bytes("image", original_bytes)`, the bytes framed
/// by their length (8 bytes little-endian). The length is known from the text (3 bytes per 4
/// characters, less the padding), so the bytes stream into the hasher as they are decoded.
pub fn base64_identifier(data: &str, model_id: &str) -> Result<String, MediaError> {
    let text = data.as_bytes();
    if !text.len().is_multiple_of(4) {
        return Err(MediaError::BadBase64);
    }
    let padding = text.iter().rev().take_while(|&&c| c == b'=').count();
    if padding > 2 {
        return Err(MediaError::BadBase64);
    }
    let decoded_len = (text.len() / 4 * 3).saturating_sub(padding);
    let mut h = blake3::Hasher::new();
    let framed = |h: &mut blake3::Hasher, bytes: &[u8]| {
        h.update(&(bytes.len() as u64).to_le_bytes());
        h.update(bytes);
    };
    framed(&mut h, b"image");
    h.update(&[TAG_LEAF]);
    framed(&mut h, b"image");
    h.update(&[TAG_LEAF]);
    h.update(&(decoded_len as u64).to_le_bytes());
    decode_into(text, padding, &mut h)?;
    framed(&mut h, b"model_id");
    h.update(&[TAG_LEAF]);
    framed(&mut h, model_id.as_bytes());
    Ok(h.finalize().to_hex().to_string())
}

/// vLLM's hasher tag in front of a leaf value.
const TAG_LEAF: u8 = 3;

/// Decodes standard base64 `text` (length a multiple of 4, `padding` trailing `=`) into `h`,
/// [`DECODE_CHUNK`] bytes at a time from one stack buffer.
fn decode_into(text: &[u8], padding: usize, h: &mut blake3::Hasher) -> Result<(), MediaError> {
    let mut buf = [0u8; DECODE_CHUNK];
    let mut used = 0;
    let quads = text.len() / 4;
    for (q, quad) in text.chunks_exact(4).enumerate() {
        let last = q + 1 == quads;
        let pad = if last { padding } else { 0 };
        let mut word: u32 = 0;
        for (i, &c) in quad.iter().enumerate() {
            let v = if i >= 4 - pad {
                0
            } else {
                u32::from(sextet(c).ok_or(MediaError::BadBase64)?)
            };
            word = (word << 6) | v;
        }
        let bytes = [(word >> 16) as u8, (word >> 8) as u8, word as u8];
        let n = 3 - pad;
        if used + n > buf.len() {
            h.update(&buf[..used]);
            used = 0;
        }
        buf[used..used + n].copy_from_slice(&bytes[..n]);
        used += n;
    }
    h.update(&buf[..used]);
    Ok(())
}

fn sextet(c: u8) -> Option<u8> {
    match c {
        b'A'..=b'Z' => Some(c - b'A'),
        b'a'..=b'z' => Some(c - b'a' + 26),
        b'0'..=b'9' => Some(c - b'0' + 52),
        b'+' => Some(62),
        b'/' => Some(63),
        _ => None,
    }
}

/// The prompt with each image's placeholder token expanded to the model's count (as vLLM's
/// prompt update does for a fixed-count processor such as LLaVA's) and each image's span. The
/// rendered prompt must hold one placeholder token per image: any other count is an error (the
/// prompt is then routed on load alone rather than keyed wrongly).
pub fn expand(
    ids: &[u32],
    config: &MediaConfig,
    items: &[MediaItem],
) -> Result<(Vec<u32>, Vec<MediaSpan>), String> {
    let found = ids.iter().filter(|&&t| t == config.image_token).count();
    if found != items.len() {
        return Err(format!(
            "{} images but {found} image placeholder tokens in the rendered prompt",
            items.len()
        ));
    }
    let n = config.tokens_per_image as usize;
    let added = items.len().saturating_mul(n);
    if added > MAX_IMAGE_TOKENS {
        return Err(format!(
            "{} images of {n} tokens: over {MAX_IMAGE_TOKENS} image tokens",
            items.len()
        ));
    }
    let extra = items.len().saturating_mul(n.saturating_sub(1));
    let mut out = Vec::with_capacity(ids.len().saturating_add(extra));
    let mut spans = Vec::with_capacity(items.len());
    let mut next = items.iter();
    for &t in ids {
        if t != config.image_token {
            out.push(t);
            continue;
        }
        let Some(item) = next.next() else {
            return Err("more image placeholders than images".into());
        };
        spans.push(MediaSpan {
            id: media_id(&item.identifier),
            offset: out.len() as u64,
            length: n as u64,
        });
        out.extend(std::iter::repeat_n(t, n));
    }
    Ok((out, spans))
}

/// Whether a part of an OpenAI message's content is an image [`items`] reads.
pub fn is_image_part(part: &Json) -> bool {
    match part.get("type").and_then(Json::as_str) {
        Some("image_url" | "input_image") => true,
        None => part.get("image_url").is_some(),
        Some(_) => false,
    }
}

#[cfg(test)]
#[path = "media_tests.rs"]
mod tests;
