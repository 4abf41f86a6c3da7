//! The streaming request-body scanner: reads a body chunk by chunk as Envoy delivers it, in one
//! pass and without building a `serde_json::Value`, and extracts what routing needs (the fields
//! of [`super::Fields`]): `model`, `stream` and `cache_salt` as raw JSON, the prompt-bearing fields
//! as raw JSON, and a flat token-id prompt as ids parsed while they arrive.
//!
//! It decides only what it is sure serde decides the same way: the body is validated as the JSON
//! serde accepts (syntax, strings, numbers, UTF-8, depth), and the extracted fields go through the
//! same code as serde's ([`super::Fields::into_parsed`]). Anything it does not settle (malformed
//! JSON, escaped or duplicate top-level keys, a prompt that is not a flat id list, very deep
//! nesting) is [`Scanned::Undecided`]: the caller parses the whole body with serde instead
//! ([`super::parse_request_body_for`]), which also words the client error. So the result equals
//! serde's on every input (`tests/body_scan.rs`, `fuzz/fuzz_targets/request_body.rs`).
//!
//! It owns no body bytes beyond the fields it copies; it never mutates the body.

// Indices are bounded by the chunk's length and counts by the body's; the one value that can
// overflow (a token id) is checked where it is read.
#![allow(clippy::arithmetic_side_effects)]

use std::borrow::Cow;

use super::layout::{is_conversation_key, BodyLayout, Span, TopField};
use super::{reads_as_ids, BodyError, Endpoint, Fields, ParsedBody, RawField};

/// Deeper nesting is left to serde (its own limit is 128 levels, this one is below it, so a
/// body the scanner accepts is never one serde refuses for depth).
pub const MAX_DEPTH: usize = 100;

/// The scanner's answer once the body is complete.
#[derive(Debug, PartialEq, Eq)]
pub enum Scanned {
    /// What [`super::parse_request_body_for`] returns for this body.
    Parsed(Result<Option<ParsedBody>, BodyError>),
    /// The scanner did not settle the body: parse it whole with serde.
    Undecided(Undecided),
}

/// Why the scanner left a body to serde.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Undecided {
    /// The first byte that is not whitespace is not `{`.
    NotAnObject,
    /// A byte the JSON grammar does not allow here, at this offset of the body.
    Syntax { at: usize },
    /// The body is not valid UTF-8.
    InvalidUtf8,
    /// A top-level key with an escape sequence (serde compares it unescaped).
    EscapedKey,
    /// A field routing reads appears twice (serde refuses the body).
    DuplicateField,
    /// Nesting deeper than [`MAX_DEPTH`].
    TooDeep,
    /// A field read as token ids is not a flat list of u32 (a batch, a float, a string...).
    NotFlatIds,
    /// The body ended before its top-level object did.
    Incomplete,
    /// `model` or `stream` is a value serde reads differently alone (e.g. a number out of range).
    Value,
}

/// The top-level fields the envelope reads, in [`Fields`]' order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    Model,
    Stream,
    CacheSalt,
    Prompt,
    Messages,
    Tools,
    Instructions,
    Input,
    System,
    Text,
    InputIds,
}

const SLOTS: [(&str, Slot); 11] = [
    ("model", Slot::Model),
    ("stream", Slot::Stream),
    ("cache_salt", Slot::CacheSalt),
    ("prompt", Slot::Prompt),
    ("messages", Slot::Messages),
    ("tools", Slot::Tools),
    ("instructions", Slot::Instructions),
    ("input", Slot::Input),
    ("system", Slot::System),
    ("text", Slot::Text),
    ("input_ids", Slot::InputIds),
];

/// Longest slot name: a longer key is not one of them.
const MAX_KEY: usize = 12;
/// Bytes per token id the id list reserves room by, as a chunk arrives (see `BodyScanner::ids`).
const IDS_RESERVE_BYTES_PER_ID: usize = 4;

impl Slot {
    fn of(key: &[u8]) -> Option<(usize, Slot)> {
        SLOTS
            .iter()
            .position(|(name, _)| name.as_bytes() == key)
            .map(|i| (i, SLOTS[i].1))
    }

    fn name(self) -> &'static str {
        SLOTS
            .iter()
            .find(|(_, s)| *s == self)
            .map_or("", |(name, _)| name)
    }

    /// Whether a body sent to `endpoint` reads this field (the others are validated, not kept).
    fn is_read(self, endpoint: Endpoint) -> bool {
        use Slot::*;
        match self {
            Model | Stream | CacheSalt => true,
            Prompt | Instructions => endpoint == Endpoint::Generate,
            Messages | Tools => matches!(endpoint, Endpoint::Generate | Endpoint::Messages),
            Input => matches!(endpoint, Endpoint::Generate | Endpoint::Embeddings),
            System => endpoint == Endpoint::Messages,
            Text | InputIds => endpoint == Endpoint::SglangGenerate,
        }
    }
}

/// A top-level field as the scanner recorded it (its key still a span of the body).
#[derive(Debug)]
struct Recorded {
    key: (usize, usize),
    value: Span,
    items: Option<Vec<Span>>,
}

/// A kept field's value: where its raw JSON lies in the body, or its ids.
#[derive(Debug)]
enum Kept {
    Span { start: usize, end: usize },
    Ids(Vec<u32>),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Str {
    Plain,
    Escape,
    /// Hex digits of a `\u` escape still to come.
    Hex(u8),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Num {
    Minus,
    Zero,
    Int,
    Dot,
    Frac,
    Exp,
    ExpSign,
    ExpDigits,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ids {
    /// After `[`: `]` or the first id.
    Open,
    /// After `,`: an id.
    Next,
    Digits,
    /// After an id: `,` or `]`.
    After,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lex {
    /// Before the top-level object.
    Start,
    /// A value is expected.
    Value,
    /// After `[`: `]` or a value.
    ArrayFirst,
    /// After `{`: `}` or a key.
    ObjectFirst,
    /// After `,` in an object: a key.
    Key,
    Colon,
    /// A value ended inside a container: `,` or the container's end.
    After,
    Str {
        key: bool,
        state: Str,
    },
    Num(Num),
    /// The rest of `true`, `false` or `null`.
    Lit {
        word: &'static [u8],
        at: u8,
    },
    Ids(Ids),
    /// The top-level object ended: only whitespace may follow.
    Done,
}

/// Reads one request body as it arrives ([`BodyScanner::feed`] per chunk, then
/// [`BodyScanner::finish`]).
#[derive(Debug)]
pub struct BodyScanner {
    endpoint: Endpoint,
    /// Not JSON by its content type: nothing to read.
    skip: bool,
    undecided: Option<Undecided>,
    lex: Lex,
    /// Open containers, `true` for an object; the top-level object is the first.
    stack: Vec<bool>,
    /// Bytes fed so far (offsets in [`Undecided::Syntax`]).
    fed: usize,
    /// The end of a UTF-8 sequence split across chunks.
    utf8_carry: Vec<u8>,
    /// The top-level key being read (only as long as a slot name can be).
    key: Vec<u8>,
    key_too_long: bool,
    /// The slot whose value comes next at the top level, and whether it is kept.
    slot: Option<(Slot, bool)>,
    /// Where the kept value being read starts in the body.
    value_start: Option<usize>,
    ids: Vec<u32>,
    /// Where the `[` of the field being read as ids is in the body.
    ids_start: usize,
    id: u64,
    id_leading_zero: bool,
    seen: u16,
    kept: [Option<Kept>; 11],
    /// Where the top-level key being read starts (past its quote) and ends.
    key_span: (usize, usize),
    /// Where the top-level value being read starts, and whether it is a list.
    top_start: Option<usize>,
    top_is_list: bool,
    /// The key is a conversation's (`messages`, `input`) and the body's API has one: the
    /// items of its list are recorded.
    conversation_key: bool,
    /// Where the item being read of a conversation list starts, and the items so far.
    item_start: usize,
    items: Vec<Span>,
    /// Every top-level field so far: key span, value span, a conversation list's items.
    fields: Vec<Recorded>,
}

impl BodyScanner {
    /// A scanner for a body sent to `endpoint` with this content type (a type that does not say
    /// JSON is not read, as [`super::parse_request_body_for`] does not read it).
    pub fn new(endpoint: Endpoint, content_type: Option<&str>) -> Self {
        let skip = content_type.is_some_and(|ct| !ct.to_ascii_lowercase().contains("json"));
        BodyScanner {
            endpoint,
            skip,
            undecided: None,
            lex: Lex::Start,
            stack: Vec::new(),
            fed: 0,
            utf8_carry: Vec::new(),
            key: Vec::with_capacity(MAX_KEY),
            key_too_long: false,
            slot: None,
            value_start: None,
            ids: Vec::new(),
            ids_start: 0,
            id: 0,
            id_leading_zero: false,
            seen: 0,
            kept: Default::default(),
            key_span: (0, 0),
            top_start: None,
            top_is_list: false,
            conversation_key: false,
            item_start: 0,
            items: Vec::new(),
            fields: Vec::new(),
        }
    }

    /// Whether the scanner already knows it will leave the body to serde.
    pub fn undecided(&self) -> Option<Undecided> {
        self.undecided
    }

    /// Reads the next chunk of the body.
    pub fn feed(&mut self, chunk: &[u8]) {
        if !self.skip && self.undecided.is_none() && !chunk.is_empty() {
            if self.utf8_ok(chunk) {
                self.scan(chunk);
            } else {
                self.stop(Undecided::InvalidUtf8);
            }
        }
        self.fed += chunk.len();
    }

    /// The body is complete: what it tells the router, or that serde must read it. `body` is the
    /// bytes fed, in order, in any chunking (the fields are copied out of it, not kept while the
    /// body arrives).
    pub fn finish<B: AsRef<[u8]>>(self, body: &[B]) -> Scanned {
        self.finish_layout(body).0
    }

    /// [`BodyScanner::finish`], and the body's [`BodyLayout`] whenever the scanner read the
    /// body as a JSON object to its end (whatever routing makes of its fields): what the
    /// tokenizer decodes the chat template's input from.
    pub fn finish_layout<B: AsRef<[u8]>>(mut self, body: &[B]) -> (Scanned, Option<BodyLayout>) {
        if self.skip || self.fed == 0 {
            return (Scanned::Parsed(Ok(None)), None);
        }
        if let Some(why) = self.undecided {
            return (Scanned::Undecided(why), None);
        }
        if self.lex != Lex::Done || !self.utf8_carry.is_empty() {
            return (Scanned::Undecided(Undecided::Incomplete), None);
        }
        let layout = self.layout(body);
        (self.fields_of(body), layout)
    }

    /// The top-level fields recorded, their keys read out of the body (keys the scanner
    /// settles have no escapes, so their bytes are their text).
    fn layout<B: AsRef<[u8]>>(&mut self, body: &[B]) -> Option<BodyLayout> {
        let mut fields = Vec::with_capacity(self.fields.len());
        for Recorded { key, value, items } in std::mem::take(&mut self.fields) {
            let (start, end) = key;
            let key = String::from_utf8(span(body, start, end).into_owned()).ok()?;
            fields.push(TopField { key, value, items });
        }
        Some(BodyLayout { fields })
    }

    /// The routing fields out of a body read to its end.
    fn fields_of<B: AsRef<[u8]>>(&mut self, body: &[B]) -> Scanned {
        let mut kept = std::mem::take(&mut self.kept);
        let [model, stream, cache_salt, prompt, messages, tools, instructions, input, system, text, input_ids] =
            &mut kept;
        let json = |k: &Option<Kept>| json(k, body);
        let field = |k: &mut Option<Kept>| field(k, body);
        let value = |k: &Option<Kept>| match json(k) {
            None => Ok(None),
            Some(raw) => serde_json::from_slice::<Option<serde_json::Value>>(&raw),
        };
        let (Ok(model), Ok(stream)) = (value(model), value(stream)) else {
            return Scanned::Undecided(Undecided::Value);
        };
        let fields = Fields {
            model,
            stream,
            cache_salt: json(cache_salt),
            prompt: field(prompt),
            messages: json(messages),
            tools: json(tools),
            instructions: json(instructions),
            input: field(input),
            system: json(system),
            text: field(text),
            input_ids: field(input_ids),
        };
        Scanned::Parsed(fields.into_parsed(self.endpoint).map(Some))
    }

    fn stop(&mut self, why: Undecided) {
        self.undecided = Some(why);
    }

    fn syntax(&mut self, at: usize) {
        self.stop(Undecided::Syntax { at: self.fed + at });
    }

    /// Validates the chunk as the continuation of UTF-8 text.
    fn utf8_ok(&mut self, mut chunk: &[u8]) -> bool {
        while !self.utf8_carry.is_empty() {
            let Some((&b, rest)) = chunk.split_first() else {
                return true;
            };
            self.utf8_carry.push(b);
            chunk = rest;
            match std::str::from_utf8(&self.utf8_carry) {
                Ok(_) => self.utf8_carry.clear(),
                Err(e) if e.error_len().is_some() => return false,
                Err(_) => {}
            }
        }
        match std::str::from_utf8(chunk) {
            Ok(_) => true,
            Err(e) if e.error_len().is_some() => false,
            Err(e) => {
                self.utf8_carry.extend_from_slice(&chunk[e.valid_up_to()..]);
                true
            }
        }
    }

    fn scan(&mut self, chunk: &[u8]) {
        let mut i = 0;
        while i < chunk.len() && self.undecided.is_none() {
            i = match self.lex {
                Lex::Str { key, state } => self.string(chunk, i, key, state),
                Lex::Ids(state) => self.ids(chunk, i, state),
                Lex::Num(state) => self.number(chunk, i, state),
                Lex::Lit { word, at } => self.literal(chunk, i, word, at),
                _ => self.structural(chunk, i),
            };
        }
    }

    /// One byte outside strings, numbers and literals; returns the next index.
    fn structural(&mut self, chunk: &[u8], i: usize) -> usize {
        let b = chunk[i];
        if matches!(b, b' ' | b'\n' | b'\t' | b'\r') {
            return i + 1;
        }
        match (self.lex, b) {
            (Lex::Start, b'{') => self.open(true),
            (Lex::Start, _) => self.stop(Undecided::NotAnObject),
            (Lex::ObjectFirst, b'}') | (Lex::After, b'}') if self.in_object() => self.close(i),
            (Lex::ArrayFirst, b']') | (Lex::After, b']') if self.in_array() => self.close(i),
            (Lex::ObjectFirst | Lex::Key, b'"') => self.start_key(i),
            (Lex::Colon, b':') => self.lex = Lex::Value,
            (Lex::After, b',') if self.in_object() => self.lex = Lex::Key,
            (Lex::After, b',') => self.lex = Lex::Value,
            (Lex::Value | Lex::ArrayFirst, _) => return self.start_value(chunk, i),
            _ => self.syntax(i),
        }
        i + 1
    }

    fn in_object(&self) -> bool {
        self.stack.last() == Some(&true)
    }

    fn in_array(&self) -> bool {
        self.stack.last() == Some(&false)
    }

    fn open(&mut self, object: bool) {
        if self.stack.len() >= MAX_DEPTH {
            self.stop(Undecided::TooDeep);
            return;
        }
        self.stack.push(object);
        self.lex = if object {
            Lex::ObjectFirst
        } else {
            Lex::ArrayFirst
        };
    }

    fn close(&mut self, i: usize) {
        self.stack.pop();
        if self.stack.is_empty() {
            self.lex = Lex::Done;
        } else {
            self.value_done(i + 1);
        }
    }

    fn start_key(&mut self, i: usize) {
        if self.stack.len() == 1 {
            self.key_span.0 = self.fed + i + 1;
            self.key.clear();
            self.key_too_long = false;
        }
        self.lex = Lex::Str {
            key: true,
            state: Str::Plain,
        };
    }

    /// The first byte of a value; returns the next index.
    fn start_value(&mut self, chunk: &[u8], i: usize) -> usize {
        let b = chunk[i];
        if self.stack.len() == 2 && self.conversation_key && self.in_array() {
            self.item_start = self.fed + i;
        }
        if self.stack.len() == 1 {
            self.top_start = Some(self.fed + i);
            self.top_is_list = b == b'[';
            if let Some((slot, true)) = self.slot {
                if b == b'[' && reads_as_ids(self.endpoint, slot.name()) {
                    self.ids = Vec::new();
                    self.ids_start = self.fed + i;
                    self.lex = Lex::Ids(Ids::Open);
                    return i + 1;
                }
                self.value_start = Some(self.fed + i);
            }
        }
        match b {
            b'{' => self.open(true),
            b'[' => self.open(false),
            b'"' => {
                self.lex = Lex::Str {
                    key: false,
                    state: Str::Plain,
                }
            }
            b'-' => self.lex = Lex::Num(Num::Minus),
            b'0' => self.lex = Lex::Num(Num::Zero),
            b'1'..=b'9' => self.lex = Lex::Num(Num::Int),
            b't' => self.lex = literal(b"rue"),
            b'f' => self.lex = literal(b"alse"),
            b'n' => self.lex = literal(b"ull"),
            _ => self.syntax(i),
        }
        i + 1
    }

    /// A value ended just before `end` (in `chunk`): at the top level, its field is stored.
    fn value_done(&mut self, end: usize) {
        self.lex = Lex::After;
        if self.stack.len() == 2 && self.conversation_key && self.in_array() {
            let start = self.item_start;
            self.items.push(Span {
                start,
                end: self.fed + end,
            });
        }
        if self.stack.len() != 1 {
            return;
        }
        self.field_done(self.fed + end);
        let slot = self.slot.take();
        if let (Some((slot, _)), Some(start)) = (slot, self.value_start.take()) {
            let end = self.fed + end;
            self.kept[slot as usize] = Some(Kept::Span { start, end });
        }
    }

    /// A top-level value ended at body offset `end`: its field joins the layout.
    fn field_done(&mut self, end: usize) {
        if let Some(start) = self.top_start.take() {
            let items = (self.conversation_key && self.top_is_list)
                .then(|| std::mem::take(&mut self.items));
            self.fields.push(Recorded {
                key: self.key_span,
                value: Span { start, end },
                items,
            });
        }
    }

    fn key_done(&mut self, i: usize) {
        self.lex = Lex::Colon;
        if self.stack.len() != 1 {
            return;
        }
        self.key_span.1 = self.fed + i;
        self.conversation_key = false;
        self.slot = None;
        if self.key_too_long {
            return;
        }
        self.conversation_key =
            self.endpoint == Endpoint::Generate && is_conversation_key(&self.key);
        if let Some((index, slot)) = Slot::of(&self.key) {
            if self.seen & (1 << index) != 0 {
                self.stop(Undecided::DuplicateField);
                return;
            }
            self.seen |= 1 << index;
            self.slot = Some((slot, slot.is_read(self.endpoint)));
        }
    }

    /// Inside a string; returns the next index.
    fn string(&mut self, chunk: &[u8], mut i: usize, key: bool, mut state: Str) -> usize {
        let top_key = key && self.stack.len() == 1;
        while i < chunk.len() {
            match state {
                Str::Plain => {
                    let run = plain_run(&chunk[i..]);
                    if top_key {
                        self.keep_key(&chunk[i..i + run]);
                    }
                    i += run;
                    let Some(&b) = chunk.get(i) else { break };
                    match b {
                        b'"' => {
                            if key {
                                self.key_done(i);
                            } else {
                                self.value_done(i + 1);
                            }
                            return i + 1;
                        }
                        b'\\' if top_key => {
                            self.stop(Undecided::EscapedKey);
                            return i;
                        }
                        b'\\' => state = Str::Escape,
                        _ => {
                            // A control character: serde refuses it inside a string.
                            self.syntax(i);
                            return i;
                        }
                    }
                }
                Str::Escape => match chunk[i] {
                    b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => state = Str::Plain,
                    b'u' => state = Str::Hex(4),
                    _ => {
                        self.syntax(i);
                        return i;
                    }
                },
                Str::Hex(left) => {
                    if !chunk[i].is_ascii_hexdigit() {
                        self.syntax(i);
                        return i;
                    }
                    state = if left == 1 {
                        Str::Plain
                    } else {
                        Str::Hex(left - 1)
                    };
                }
            }
            i += 1;
        }
        self.lex = Lex::Str { key, state };
        i
    }

    fn keep_key(&mut self, bytes: &[u8]) {
        if self.key.len() + bytes.len() > MAX_KEY {
            self.key_too_long = true;
        } else {
            self.key.extend_from_slice(bytes);
        }
    }

    /// Inside a number; returns the next index.
    fn number(&mut self, chunk: &[u8], mut i: usize, mut state: Num) -> usize {
        while let Some(&b) = chunk.get(i) {
            let next = match (state, b) {
                (Num::Minus, b'0') => Num::Zero,
                (Num::Minus, b'1'..=b'9') => Num::Int,
                (Num::Int, b'0'..=b'9') => Num::Int,
                (Num::Zero | Num::Int, b'.') => Num::Dot,
                (Num::Dot | Num::Frac, b'0'..=b'9') => Num::Frac,
                (Num::Zero | Num::Int | Num::Frac, b'e' | b'E') => Num::Exp,
                (Num::Exp, b'+' | b'-') => Num::ExpSign,
                (Num::Exp | Num::ExpSign | Num::ExpDigits, b'0'..=b'9') => Num::ExpDigits,
                (Num::Zero | Num::Int | Num::Frac | Num::ExpDigits, _) => {
                    // The byte after the number is the container's to read.
                    self.value_done(i);
                    return i;
                }
                _ => {
                    self.syntax(i);
                    return i;
                }
            };
            state = next;
            i += 1;
        }
        self.lex = Lex::Num(state);
        i
    }

    fn literal(&mut self, chunk: &[u8], mut i: usize, word: &'static [u8], mut at: u8) -> usize {
        while let (Some(&b), Some(&want)) = (chunk.get(i), word.get(at as usize)) {
            if b != want {
                self.syntax(i);
                return i;
            }
            at += 1;
            i += 1;
        }
        if at as usize == word.len() {
            self.value_done(i);
        } else {
            self.lex = Lex::Lit { word, at };
        }
        i
    }

    /// Inside a top-level field read as token ids; returns the next index.
    fn ids(&mut self, chunk: &[u8], mut i: usize, mut state: Ids) -> usize {
        // An id with its comma takes at least two bytes and usually more than four: room for a
        // quarter of the chunk's bytes spares most of the doublings (~11 reallocations and
        // copies of the list per 32 KB body) and never reserves more than the chunk's own size.
        self.ids
            .reserve(chunk.len().saturating_sub(i) / IDS_RESERVE_BYTES_PER_ID);
        while let Some(&b) = chunk.get(i) {
            match (state, b) {
                // An id split across chunks, byte by byte.
                (Ids::Digits, b'0'..=b'9') => {
                    self.id = self.id * 10 + u64::from(b - b'0');
                    if self.id_leading_zero || self.id > u64::from(u32::MAX) {
                        return self.not_ids(i);
                    }
                    i += 1;
                }
                (Ids::Digits, _) => {
                    self.ids.push(self.id as u32);
                    state = Ids::After;
                }
                (Ids::Open | Ids::Next, b'0'..=b'9') => {
                    // The usual run (`id,id,id`) is read here without going back through the
                    // state match for every comma.
                    while let Some((id, len)) = short_id(&chunk[i..]) {
                        if chunk[i] == b'0' && len > 1 {
                            return self.not_ids(i + 1);
                        }
                        self.ids.push(id);
                        i += len;
                        state = Ids::After;
                        match chunk.get(i..i + 2) {
                            Some([b',', b'0'..=b'9']) => {
                                i += 1;
                                state = Ids::Next;
                            }
                            _ => break,
                        }
                    }
                    if state != Ids::After {
                        let b = chunk[i];
                        self.id = u64::from(b - b'0');
                        self.id_leading_zero = b == b'0';
                        state = Ids::Digits;
                        i += 1;
                    }
                }
                (_, b' ' | b'\n' | b'\t' | b'\r') => i += 1,
                (Ids::After, b',') => {
                    state = Ids::Next;
                    i += 1;
                }
                (Ids::Open | Ids::After, b']') => {
                    self.field_done(self.fed + i + 1);
                    if let Some((slot, _)) = self.slot.take() {
                        self.kept[slot as usize] = Some(Kept::Ids(std::mem::take(&mut self.ids)));
                    }
                    self.lex = Lex::After;
                    return i + 1;
                }
                (Ids::Open, _) => return self.ids_as_json(i),
                _ => return self.not_ids(i),
            }
        }
        self.lex = Lex::Ids(state);
        i
    }

    /// The field's first element is not an id (a string, a nested list): it is read as raw JSON
    /// from its `[` on.
    fn ids_as_json(&mut self, i: usize) -> usize {
        self.value_start = Some(self.ids_start);
        self.open(false);
        i
    }

    fn not_ids(&mut self, i: usize) -> usize {
        self.stop(Undecided::NotFlatIds);
        i
    }
}

fn literal(rest: &'static [u8]) -> Lex {
    Lex::Lit { word: rest, at: 0 }
}

/// A kept field's raw JSON out of the body (`null` is absent).
fn json<'a, B: AsRef<[u8]>>(kept: &Option<Kept>, body: &'a [B]) -> Option<Cow<'a, [u8]>> {
    match kept {
        Some(Kept::Span { start, end }) => {
            Some(span(body, *start, *end)).filter(|raw| **raw != *b"null")
        }
        _ => None,
    }
}

/// A prompt-bearing field; its ids, if it holds ids, move out.
fn field<'a, B: AsRef<[u8]>>(kept: &mut Option<Kept>, body: &'a [B]) -> Option<RawField<'a>> {
    match kept {
        Some(Kept::Ids(ids)) => Some(RawField::Ids(std::mem::take(ids))),
        other => json(other, body).map(RawField::Json),
    }
}

/// The bytes `start..end` of a body in chunks: borrowed from one chunk, or copied once out of
/// several (with room for the NUL [`super::Fields`] ends a prompt part with).
fn span<B: AsRef<[u8]>>(body: &[B], start: usize, end: usize) -> Cow<'_, [u8]> {
    let mut offset = 0;
    for (k, chunk) in body.iter().enumerate() {
        let chunk = chunk.as_ref();
        let next = offset + chunk.len();
        if start < next {
            let from = start - offset;
            if end <= next {
                return Cow::Borrowed(&chunk[from..end - offset]);
            }
            let mut out = Vec::with_capacity(end - start + 1);
            out.extend_from_slice(&chunk[from..]);
            for more in &body[k + 1..] {
                let more = more.as_ref();
                let take = (end - start - out.len()).min(more.len());
                out.extend_from_slice(&more[..take]);
                if out.len() == end - start {
                    break;
                }
            }
            return Cow::Owned(out);
        }
        offset = next;
    }
    Cow::Borrowed(&[])
}

const ONES: u64 = 0x0101_0101_0101_0101;
const HIGHS: u64 = 0x8080_8080_8080_8080;

/// An id of at most seven digits at the start of `s` followed by a byte that is not a digit,
/// read eight bytes at a time: `(id, digits)`. `None` when `s` is shorter than eight bytes or
/// the run is longer (the byte-by-byte reader takes those).
fn short_id(s: &[u8]) -> Option<(u32, usize)> {
    let bytes: [u8; 8] = s.get(..8)?.try_into().ok()?;
    let x = u64::from_le_bytes(bytes) ^ (ONES * u64::from(b'0'));
    // A byte is a digit when x < 10: its high bit stays clear after adding 0x76. A carry out of
    // a byte only reaches bytes after the first non-digit.
    let not_digit = (x | x.wrapping_add(ONES * 0x76)) & HIGHS;
    let len = (not_digit.trailing_zeros() / 8) as usize;
    if len == 8 {
        return None;
    }
    // The digits moved to the top bytes, zeros before them, then read as an eight-digit number
    // in three multiply steps (pairs, quads, the whole; Lemire's method).
    let v = x << (8 * (8 - len));
    let v = v.wrapping_mul(10).wrapping_add(v >> 8);
    let v = ((v & 0x0000_00FF_0000_00FF)
        .wrapping_mul(100 + (1_000_000 << 32))
        .wrapping_add(((v >> 16) & 0x0000_00FF_0000_00FF).wrapping_mul(1 + (10_000 << 32))))
        >> 32;
    Some((v as u32, len))
}

/// The length of the run of string bytes that need no attention (not `"`, `\` or a control
/// character): 32 bytes at a time in a loop the compiler turns into vector compares.
fn plain_run(s: &[u8]) -> usize {
    let special = |b: u8| (b == b'"') | (b == b'\\') | (b < 0x20);
    let mut i = 0;
    for block in s.chunks_exact(32) {
        if block.iter().fold(false, |hit, &b| hit | special(b)) {
            break;
        }
        i += 32;
    }
    i + s[i..]
        .iter()
        .position(|&b| special(b))
        .unwrap_or(s.len() - i)
}

impl BodyLayout {
    /// The layout of a complete body sent to `endpoint`: the scanner's reading when it settles
    /// the body, else serde's. The error is the body's JSON error.
    pub fn of(endpoint: Endpoint, body: &[u8]) -> Result<Self, String> {
        let mut scanner = BodyScanner::new(endpoint, None);
        scanner.feed(body);
        match scanner.finish_layout(&[body]) {
            (_, Some(layout)) => Ok(layout),
            (_, None) => Self::from_serde(endpoint, body),
        }
    }
}

/// [`super::parse_request_body_for`] over a body in chunks: scanned, and parsed whole by serde
/// only when the scanner leaves it undecided.
pub fn parse_chunks(
    endpoint: Endpoint,
    content_type: Option<&str>,
    chunks: &[&[u8]],
) -> Result<Option<ParsedBody>, BodyError> {
    let mut scanner = BodyScanner::new(endpoint, content_type);
    for chunk in chunks {
        scanner.feed(chunk);
    }
    match scanner.finish(chunks) {
        Scanned::Parsed(parsed) => parsed,
        Scanned::Undecided(_) => {
            super::parse_request_body_for(endpoint, content_type, &chunks.concat())
        }
    }
}

#[cfg(test)]
#[path = "scan_tests.rs"]
mod tests;
