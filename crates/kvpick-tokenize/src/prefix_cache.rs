//! Incremental tokenization with a bounded prefix cache (ARCHITECTURE.md §8): agentic turns resend a
//! growing conversation, so a request's cost should grow with its new text, not its length.
//! This module owns the cache and the "resume from a safe boundary" rule; it knows nothing about
//! chat templates, requests or routing (it tokenizes plain text for one tokenizer).
//!
//! How it stays exact. A rendered prompt is cut at *checkpoints* (`tokenize::boundary`): byte
//! positions at least [`CHUNK`] bytes apart where the tokenizer's restart rules put restart
//! points (after a `\n`, after or at a space), chosen left to right from the text alone, so two
//! texts that share a prefix share every checkpoint inside it. Each tokenized text (a [`Doc`]:
//! text, ids, byte offsets) is registered under the xxh3 hash of every checkpoint prefix. A new
//! text looks up its longest registered checkpoint prefix (verified byte for byte, so a hash
//! collision cannot mix conversations), extends it to the first byte where the texts differ,
//! keeps the cached tokens up to a *restart point* before that byte and tokenizes only the rest.
//! Which restart rules hold depends on the pre-tokenizer (line starts for byte-level BPE, word
//! starts for whitespace splitters and word-level models, space starts for `Metaspace`); a
//! self-check at load time ([`IncrementalTokenizer::new`]) picks the ones that hold for this
//! tokenizer, and a tokenizer for which none holds runs cold.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;
use tokenizers::Tokenizer;

pub use super::boundary::CHUNK;
use super::boundary::{self, Rules, Tokens};
use super::fast::{Encoded, FastEncoder};

/// One tokenized text: the text and, per token, its id and byte span.
#[derive(Debug)]
struct Doc {
    text: String,
    ids: Vec<u32>,
    starts: Vec<u32>,
    ends: Vec<u32>,
    /// Checkpoints registered for this doc: (hash, prefix length).
    keys: Vec<(u64, usize)>,
}

impl Doc {
    fn tokens(&self) -> usize {
        self.ids.len()
    }
}

struct Entry {
    doc: u64,
    /// The checkpoint: `doc.text[..len]` is the prefix this entry stands for.
    len: usize,
}

struct DocSlot {
    doc: Arc<Doc>,
    last_used: u64,
    /// Entries of `map` that point at this doc.
    live_entries: usize,
}

#[derive(Default)]
struct Inner {
    map: HashMap<u64, Entry>,
    docs: HashMap<u64, DocSlot>,
    next_doc: u64,
    clock: u64,
    tokens: usize,
}

/// Cache statistics (for tests and metrics).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    pub docs: usize,
    pub entries: usize,
    pub tokens: usize,
}

/// How a text was tokenized.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    /// Tokenized from the start.
    Cold,
    /// Resumed from a cached prefix; `reused` tokens came from the cache.
    Cached { reused: usize },
}

/// Bounded LRU prefix cache for one tokenizer.
pub struct PrefixCache {
    inner: Mutex<Inner>,
    max_tokens: usize,
}

impl PrefixCache {
    /// A cache holding at most about `max_tokens` tokens (the most recent doc is always kept).
    pub fn new(max_tokens: usize) -> Self {
        PrefixCache {
            inner: Mutex::new(Inner::default()),
            max_tokens,
        }
    }

    pub fn stats(&self) -> CacheStats {
        let inner = self.inner.lock();
        CacheStats {
            docs: inner.docs.len(),
            entries: inner.map.len(),
            tokens: inner.tokens,
        }
    }

    /// The longest cached doc sharing a checkpoint prefix with `text`: (doc, checkpoint length).
    fn lookup(&self, text: &str, checkpoints: &[(usize, u64)]) -> Option<(Arc<Doc>, u64, usize)> {
        let mut inner = self.inner.lock();
        inner.clock += 1;
        let now = inner.clock;
        for &(len, key) in checkpoints.iter().rev() {
            let Some(entry) = inner.map.get(&key) else {
                continue;
            };
            if entry.len != len {
                continue;
            }
            let doc_id = entry.doc;
            let Some(slot) = inner.docs.get_mut(&doc_id) else {
                continue;
            };
            let doc = &slot.doc;
            if doc.text.len() >= len && doc.text.as_bytes()[..len] == text.as_bytes()[..len] {
                slot.last_used = now;
                return Some((Arc::clone(&slot.doc), doc_id, len));
            }
        }
        None
    }

    /// Turns cached doc `id` into `text` in place when nobody else is reading it: `doc` (the
    /// caller's handle, dropped here) shares `text[..restart]` and `tokens` are the ids and spans
    /// of `text[restart..]` from token `keep` on. This is what keeps a new turn's cost
    /// proportional to its new text: nothing of the shared history is copied. Hands the tokens
    /// back with the handle when the doc is shared or gone, for [`PrefixCache::insert`].
    fn extend_in_place(
        &self,
        doc: Arc<Doc>,
        id: u64,
        text: &str,
        keep: usize,
        tail: Tail,
        keys: Vec<(u64, usize)>,
    ) -> Result<(), HandedBack> {
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        let Some(slot) = inner.docs.get_mut(&id) else {
            return Err((doc, tail, keys));
        };
        // New handles are only made under the lock, so with just ours and the slot's, dropping
        // ours leaves the slot's unique.
        if !Arc::ptr_eq(&slot.doc, &doc) || Arc::strong_count(&doc) != 2 {
            return Err((doc, tail, keys));
        }
        drop(doc);
        let Some(owned) = Arc::get_mut(&mut slot.doc) else {
            return Ok(());
        };
        inner.clock += 1;
        slot.last_used = inner.clock;
        let old_tokens = owned.ids.len();
        for (key, _) in std::mem::take(&mut owned.keys) {
            if inner.map.get(&key).is_some_and(|e| e.doc == id) {
                inner.map.remove(&key);
            }
        }
        slot.live_entries = 0;
        let restart = tail.from;
        owned.text.truncate(restart);
        owned.text.push_str(&text[restart..]);
        owned.ids.truncate(keep);
        owned.starts.truncate(keep);
        owned.ends.truncate(keep);
        owned.ids.extend_from_slice(&tail.ids);
        owned.starts.extend_from_slice(&tail.starts);
        owned.ends.extend_from_slice(&tail.ends);
        owned.keys = keys;
        let new_tokens = owned.ids.len();
        inner.tokens = inner.tokens - old_tokens + new_tokens;
        inner.register(id);
        inner.evict(self.max_tokens, id);
        Ok(())
    }

    fn insert(&self, doc: Doc) {
        let mut inner = self.inner.lock();
        inner.clock += 1;
        let now = inner.clock;
        let id = inner.next_doc;
        inner.next_doc += 1;
        let tokens = doc.tokens();
        inner.docs.insert(
            id,
            DocSlot {
                doc: Arc::new(doc),
                last_used: now,
                live_entries: 0,
            },
        );
        inner.tokens += tokens;
        inner.register(id);
        inner.evict(self.max_tokens, id);
    }
}

impl Inner {
    /// Points the map at doc `id` for each of its checkpoints (taking them over from older
    /// docs); a doc with no checkpoint left (text shorter than a chunk) is dropped.
    fn register(&mut self, id: u64) {
        let Some(slot) = self.docs.get(&id) else {
            return;
        };
        let doc = Arc::clone(&slot.doc);
        for &(key, len) in &doc.keys {
            let old = self.map.insert(key, Entry { doc: id, len });
            if let Some(old) = old {
                if old.doc != id {
                    self.release_entry(old.doc);
                } else if let Some(slot) = self.docs.get_mut(&id) {
                    // The same checkpoint listed twice: count it once.
                    slot.live_entries -= 1;
                }
            }
            if let Some(slot) = self.docs.get_mut(&id) {
                slot.live_entries += 1;
            }
        }
        if self.docs.get(&id).is_some_and(|s| s.live_entries == 0) {
            self.drop_doc(id);
        }
    }

    /// Drops least recently used docs (never `keep`) until the token bound holds.
    fn evict(&mut self, max_tokens: usize, keep: u64) {
        while self.tokens > max_tokens && self.docs.len() > 1 {
            let Some(oldest) = self
                .docs
                .iter()
                .filter(|(d, _)| **d != keep)
                .min_by_key(|(_, s)| s.last_used)
                .map(|(d, _)| *d)
            else {
                break;
            };
            self.drop_doc(oldest);
        }
    }

    fn release_entry(&mut self, doc: u64) {
        let empty = match self.docs.get_mut(&doc) {
            Some(slot) => {
                slot.live_entries = slot.live_entries.saturating_sub(1);
                slot.live_entries == 0
            }
            None => false,
        };
        if empty {
            self.drop_doc(doc);
        }
    }

    fn drop_doc(&mut self, doc: u64) {
        if let Some(slot) = self.docs.remove(&doc) {
            self.tokens -= slot.doc.tokens();
            for (key, _) in &slot.doc.keys {
                if self.map.get(key).is_some_and(|e| e.doc == doc) {
                    self.map.remove(key);
                }
            }
        }
    }
}

/// A tokenizer plus its prefix cache: `tokenize(text)` equals a cold
/// `tokenizer.encode(text, false)` id for id.
pub struct IncrementalTokenizer {
    tokenizer: Arc<Tokenizer>,
    /// The direct encoder, when the tokenizer has its shape and agrees with it.
    fast: Option<FastEncoder>,
    cache: Option<PrefixCache>,
    /// The restart rules that hold for this tokenizer (the cache is off when none does).
    rules: Rules,
}

/// Tokenization errors (the tokenizer's own, stringified).
#[derive(Debug, thiserror::Error)]
#[error("tokenizer: {0}")]
pub struct TokenizeError(pub String);

impl IncrementalTokenizer {
    /// Wraps `tokenizer`; with `max_cached_tokens == 0` or when the load-time self-check finds
    /// no restart rule holds for the tokenizer (`tokenize::boundary`), every call tokenizes cold.
    pub fn new(tokenizer: Arc<Tokenizer>, max_cached_tokens: usize) -> Self {
        Self::with_fast(tokenizer, None, max_cached_tokens)
    }

    /// [`IncrementalTokenizer::new`] that encodes with `fast` (already checked to agree with
    /// `tokenizer`) instead of the general pipeline.
    pub fn with_fast(
        tokenizer: Arc<Tokenizer>,
        fast: Option<FastEncoder>,
        max_cached_tokens: usize,
    ) -> Self {
        let mut inc = IncrementalTokenizer {
            tokenizer,
            fast,
            cache: None,
            rules: Rules::default(),
        };
        if max_cached_tokens > 0 {
            inc.rules = boundary::accepted_rules(|text| {
                inc.encode_spans(text).ok().map(|e| boundary::Encoding {
                    ids: e.ids,
                    starts: e.starts,
                    ends: e.ends,
                })
            });
            if inc.rules.is_empty() {
                tracing::warn!("no restart rule holds for this tokenizer: prefix cache disabled");
            } else {
                inc.cache = Some(PrefixCache::new(max_cached_tokens));
            }
        }
        inc
    }

    pub fn uses_fast_encoder(&self) -> bool {
        self.fast.is_some()
    }

    /// Ids and byte spans of `text` (no special tokens added).
    fn encode_spans(&self, text: &str) -> Result<Encoded, TokenizeError> {
        if let Some(fast) = &self.fast {
            return fast.encode(text).map_err(TokenizeError);
        }
        let enc = self
            .tokenizer
            .encode(text, false)
            .map_err(|e| TokenizeError(e.to_string()))?;
        Ok(Encoded {
            ids: enc.get_ids().to_vec(),
            starts: enc.get_offsets().iter().map(|o| o.0 as u32).collect(),
            ends: enc.get_offsets().iter().map(|o| o.1 as u32).collect(),
        })
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    pub fn cache_enabled(&self) -> bool {
        self.cache.is_some()
    }

    /// The restart rules the cache resumes at (empty: no cache).
    pub fn restart_rules(&self) -> Rules {
        self.rules
    }

    pub fn cache_stats(&self) -> CacheStats {
        self.cache.as_ref().map(|c| c.stats()).unwrap_or_default()
    }

    /// Cold tokenization (no special tokens added).
    pub fn tokenize_cold(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        if let Some(fast) = &self.fast {
            return fast.encode(text).map(|e| e.ids).map_err(TokenizeError);
        }
        let enc = self
            .tokenizer
            .encode_fast(text, false)
            .map_err(|e| TokenizeError(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Token ids of `text` (no special tokens added), using and refreshing the prefix cache.
    pub fn tokenize(&self, text: &str) -> Result<(Vec<u32>, Path), TokenizeError> {
        let Some(cache) = &self.cache else {
            return Ok((self.tokenize_cold(text)?, Path::Cold));
        };
        let checkpoints = boundary::checkpoints(text, self.rules);
        if checkpoints.is_empty() {
            return Ok((self.tokenize_cold(text)?, Path::Cold));
        }
        let keys: Vec<(u64, usize)> = checkpoints.iter().map(|&(l, k)| (k, l)).collect();
        let Some((doc, doc_id, len)) = cache.lookup(text, &checkpoints) else {
            let tail = self.encode_tail(text, 0)?;
            let ids = tail.ids.clone();
            cache.insert(Doc::joined(&ids, (&[], &[]), text, tail, keys));
            return Ok((ids, Path::Cold));
        };
        // The texts agree up to the checkpoint; extend that to where they really diverge,
        // so only the new text (not the rest of the last chunk) is tokenized again.
        let shared = len + common_prefix(&doc.text.as_bytes()[len..], &text.as_bytes()[len..]);
        let tokens = Tokens {
            text: &doc.text,
            starts: &doc.starts,
            ends: &doc.ends,
        };
        let keep = boundary::restart_token(&tokens, shared, self.rules).unwrap_or(0);
        let from = if keep == 0 {
            0
        } else {
            doc.starts[keep] as usize
        };
        let tail = self.encode_tail(text, from)?;
        let mut ids = Vec::with_capacity(keep + tail.ids.len());
        ids.extend_from_slice(&doc.ids[..keep]);
        ids.extend_from_slice(&tail.ids);
        let path = if keep == 0 {
            Path::Cold
        } else {
            Path::Cached { reused: keep }
        };
        // A request that continues the cached text (it loses at most a chunk of the doc's own
        // tail) takes the doc over; a branch that leaves more behind gets a doc of its own, so
        // parallel conversations with a common start do not evict each other's histories.
        let (doc, tail, keys) = if doc.text.len() - shared <= CHUNK {
            match cache.extend_in_place(doc, doc_id, text, keep, tail, keys) {
                Ok(()) => return Ok((ids, path)),
                Err(handed_back) => handed_back,
            }
        } else {
            (doc, tail, keys)
        };
        let new_doc = Doc::joined(
            &ids,
            (&doc.starts[..keep], &doc.ends[..keep]),
            text,
            tail,
            keys,
        );
        drop(doc);
        cache.insert(new_doc);
        Ok((ids, path))
    }

    /// Tokenizes `text[from..]` with byte spans relative to `text`.
    fn encode_tail(&self, text: &str, from: usize) -> Result<Tail, TokenizeError> {
        let mut enc = self.encode_spans(&text[from..])?;
        let base = from as u32;
        for s in enc.starts.iter_mut().chain(enc.ends.iter_mut()) {
            *s += base;
        }
        Ok(Tail {
            from,
            ids: enc.ids,
            starts: enc.starts,
            ends: enc.ends,
        })
    }
}

/// What [`PrefixCache::extend_in_place`] returns when it cannot take the doc over.
type HandedBack = (Arc<Doc>, Tail, Vec<(u64, usize)>);

/// The freshly tokenized end of a text: `text[from..]`'s ids and byte spans (relative to the
/// whole text).
struct Tail {
    from: usize,
    ids: Vec<u32>,
    starts: Vec<u32>,
    ends: Vec<u32>,
}

impl Doc {
    /// A doc for `text` with ids `ids`: the spans `prefix` of the tokens kept from a cached
    /// doc, then `tail`'s. Capacity leaves room for the next turns, so extending the doc in
    /// place does not copy.
    fn joined(
        ids: &[u32],
        prefix: (&[u32], &[u32]),
        text: &str,
        tail: Tail,
        keys: Vec<(u64, usize)>,
    ) -> Doc {
        let capacity = with_headroom(ids.len());
        let with_room = |kept: &[u32], new: &[u32]| {
            let mut v = Vec::with_capacity(capacity);
            v.extend_from_slice(kept);
            v.extend_from_slice(new);
            v
        };
        let mut own_text = String::with_capacity(with_headroom(text.len()));
        own_text.push_str(text);
        Doc {
            text: own_text,
            ids: with_room(ids, &[]),
            starts: with_room(prefix.0, &tail.starts),
            ends: with_room(prefix.1, &tail.ends),
            keys,
        }
    }
}

/// A quarter more, at most 16 Ki more (tokens or bytes): room for a few more agent turns.
fn with_headroom(len: usize) -> usize {
    len + (len / 4).min(16 * 1024)
}

/// Length of the common prefix of two byte strings.
pub(crate) fn common_prefix(a: &[u8], b: &[u8]) -> usize {
    const STEP: usize = 64;
    let n = a.len().min(b.len());
    let mut i = 0;
    while i + STEP <= n && a[i..i + STEP] == b[i..i + STEP] {
        i += STEP;
    }
    while i < n && a[i] == b[i] {
        i += 1;
    }
    i
}

#[cfg(any(test, feature = "testutil"))]
pub mod testutil {
    //! A small byte-level BPE tokenizer (GPT-2 pre-tokenizer regex) built in code, so unit tests
    //! need no files (the host's tests reach it through the `testutil` feature).

    use std::collections::BTreeMap;

    /// Words for random test texts: whitespace runs, line ends, numbers, CJK, accents, emoji,
    /// code, contractions, the added token and a near miss of it.
    pub const WORDS: [&str; 30] = [
        "the",
        " answer",
        "12345",
        "3.14",
        "ünïcödé",
        "漢字",
        "テスト",
        "  ",
        "\t",
        "\n",
        "\n\n",
        "   \n",
        "<|im_start|>",
        "<|im_start|",
        "assistant",
        "{\"k\": [1, 2]}",
        "don't",
        "I'll",
        "!!",
        "?",
        "😀",
        "    indented",
        "x=1;",
        "-",
        "\r\n",
        "\u{a0}",
        "café",
        "数据",
        "a_b",
        "'s",
    ];

    /// The tokenizer.json text.
    pub fn tokenizer_json() -> String {
        let map = crate::fast::bytes_to_unicode();
        let mut vocab: BTreeMap<String, u32> = BTreeMap::new();
        for c in &map {
            let next = vocab.len() as u32;
            vocab.entry(c.to_string()).or_insert(next);
        }
        let merges = [
            ("Ġ", "t"),
            ("h", "e"),
            ("Ġt", "he"),
            ("i", "n"),
            ("Ġ", "a"),
            ("e", "r"),
            ("o", "n"),
            ("Ġ", "w"),
            ("o", "r"),
            ("Ġ", "s"),
            ("Ċ", "Ċ"),
            ("Ġ", "Ġ"),
            ("ĠĠ", "ĠĠ"),
            ("1", "2"),
            ("Ġ", "in"),
            ("a", "n"),
            ("Ġ", "o"),
            ("e", "n"),
            ("<", "|"),
            ("|", ">"),
            ("i", "m"),
            ("s", "t"),
        ];
        let mut merge_list = Vec::new();
        for (a, b) in merges {
            let next = vocab.len() as u32;
            vocab.entry(format!("{a}{b}")).or_insert(next);
            merge_list.push(format!("{a} {b}"));
        }
        let special_id = vocab.len() as u32;
        let byte_level = serde_json::json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
        serde_json::json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": [{"id": special_id, "content": "<|im_start|>", "single_word": false,
                "lstrip": false, "rstrip": false, "normalized": false, "special": true}],
            "normalizer": null,
            "pre_tokenizer": byte_level,
            "post_processor": byte_level,
            "decoder": byte_level,
            "model": {"type": "BPE", "dropout": null, "unk_token": null,
                "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": false,
                "byte_fallback": false, "ignore_merges": false, "vocab": vocab, "merges": merge_list}
        })
        .to_string()
    }

    // Test support only (a fixed, valid tokenizer.json): a panic is a failed test.
    #[allow(clippy::unwrap_used)]
    pub fn tokenizer() -> tokenizers::Tokenizer {
        tokenizers::Tokenizer::from_bytes(tokenizer_json().as_bytes()).unwrap()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{rngs::StdRng, Rng, SeedableRng};

    use testutil::WORDS;

    fn random_text(rng: &mut StdRng, bytes: usize) -> String {
        let mut s = String::new();
        while s.len() < bytes {
            s.push_str(WORDS[rng.random_range(0..WORDS.len())]);
            if rng.random_bool(0.6) {
                s.push(' ');
            }
            if rng.random_bool(0.08) {
                s.push('\n');
            }
        }
        s
    }

    fn cold(tok: &Tokenizer, text: &str) -> Vec<u32> {
        tok.encode(text, false).unwrap().get_ids().to_vec()
    }

    #[test]
    fn checkpoints_are_prefix_stable() {
        let mut rng = StdRng::seed_from_u64(7);
        let a = random_text(&mut rng, 20_000);
        let b = format!("{a}{}", random_text(&mut rng, 5_000));
        let rules = Rules::default().with(boundary::Rule::LineStart);
        let ca = boundary::checkpoints(&a, rules);
        let cb = boundary::checkpoints(&b, rules);
        assert!(ca.len() > 3);
        assert_eq!(&cb[..ca.len()], &ca[..]);
        for (len, _) in &ca {
            assert_eq!(a.as_bytes()[len - 1], b'\n');
        }
    }

    #[test]
    fn self_check_accepts_byte_level_bpe() {
        let inc = IncrementalTokenizer::new(Arc::new(testutil::tokenizer()), 100_000);
        assert!(inc.cache_enabled());
    }

    /// Growing conversations (agentic turns), interleaved, edited and evicted: every result is
    /// exactly the cold tokenization.
    #[test]
    fn randomized_conversations_equal_cold_tokenization() {
        let tok = Arc::new(testutil::tokenizer());
        let inc = IncrementalTokenizer::new(Arc::clone(&tok), 40_000);
        let mut rng = StdRng::seed_from_u64(42);
        let mut convs: Vec<String> = (0..4).map(|_| random_text(&mut rng, 3_000)).collect();
        let mut cached_hits = 0;
        for _ in 0..120 {
            let i = rng.random_range(0..convs.len());
            match rng.random_range(0..10) {
                // A new turn appends text (sometimes without a trailing newline).
                0..=6 => {
                    let n = rng.random_range(1..3_000);
                    let extra = random_text(&mut rng, n);
                    convs[i].push_str(&extra);
                }
                // The client edits the tail of the conversation.
                7 | 8 => {
                    let mut cut = rng.random_range(0..convs[i].len());
                    while !convs[i].is_char_boundary(cut) {
                        cut -= 1;
                    }
                    convs[i].truncate(cut);
                    convs[i].push_str(&random_text(&mut rng, 500));
                }
                // A branch: a new conversation sharing a prefix.
                _ => {
                    let mut cut = rng.random_range(0..convs[i].len());
                    while !convs[i].is_char_boundary(cut) {
                        cut -= 1;
                    }
                    let branch = format!("{}{}", &convs[i][..cut], random_text(&mut rng, 800));
                    convs.push(branch);
                }
            }
            let text = convs[i].clone();
            let (ids, path) = inc.tokenize(&text).unwrap();
            assert_eq!(ids, cold(&tok, &text), "mismatch on path {path:?}");
            if matches!(path, Path::Cached { .. }) {
                cached_hits += 1;
            }
        }
        assert!(cached_hits > 40, "cache used {cached_hits} times");
        assert!(inc.cache_stats().tokens <= 40_000 + 20_000);
    }

    #[test]
    fn cache_bound_evicts_least_recent_docs() {
        let tok = Arc::new(testutil::tokenizer());
        let inc = IncrementalTokenizer::new(Arc::clone(&tok), 5_000);
        let mut rng = StdRng::seed_from_u64(3);
        for _ in 0..10 {
            let text = random_text(&mut rng, 8_000);
            inc.tokenize(&text).unwrap();
        }
        let stats = inc.cache_stats();
        assert_eq!(stats.docs, 1, "{stats:?}");
    }

    #[test]
    fn next_turn_reuses_most_tokens() {
        let tok = Arc::new(testutil::tokenizer());
        let inc = IncrementalTokenizer::new(Arc::clone(&tok), 1_000_000);
        let mut rng = StdRng::seed_from_u64(9);
        let mut text = random_text(&mut rng, 50_000);
        let (first, path) = inc.tokenize(&text).unwrap();
        assert_eq!(path, Path::Cold);
        text.push_str(&random_text(&mut rng, 1_000));
        let (ids, path) = inc.tokenize(&text).unwrap();
        assert_eq!(ids, cold(&tok, &text));
        let Path::Cached { reused } = path else {
            panic!("expected a cache hit")
        };
        assert!(
            reused > first.len() * 9 / 10,
            "reused {reused} of {}",
            first.len()
        );
    }
}
