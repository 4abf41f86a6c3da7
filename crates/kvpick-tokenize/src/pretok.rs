//! The pre-tokenizers the direct encoder reproduces (`tokenize::fast`), as `tokenizers` 0.23
//! defines them: `Split` (string or regex, every delimiter behaviour, inverted or not),
//! `Whitespace`, `WhitespaceSplit`, `Punctuation`, `Digits`, `BertPreTokenizer`,
//! `CharDelimiterSplit`, and a `Sequence` of those, optionally ending in `ByteLevel` (bytes mapped
//! to GPT-2's characters) or `Metaspace` (spaces replaced, a prefix prepended, split before each
//! replacement). Each step finds its matches the way `tokenizers`' `Pattern` does and folds them by
//! the same rules (`NormalizedString::split`), on byte ranges of the input instead of aligned
//! strings, which is where the general pipeline spends most of its time.
//!
//! Read from the loaded tokenizer's own serialization (so defaults and legacy fields are already
//! resolved). This module owns only the splitting; it knows nothing about models or added tokens.

use fancy_regex::Regex;
use serde_json::Value;
use unicode_categories::UnicodeCategories;

/// GPT-2's pre-tokenization regex, which `ByteLevel { use_regex: true }` applies.
const BYTE_LEVEL_REGEX: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
/// `Whitespace`'s regex (the `regex` crate, as `tokenizers` compiles it).
const WHITESPACE_REGEX: &str = r"\w+|[^\w\s]+";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Behavior {
    Removed,
    Isolated,
    MergedWithPrevious,
    MergedWithNext,
    Contiguous,
}

/// Characters a step splits on, one match per character (`Pattern for Fn(char) -> bool`).
#[derive(Debug, Clone, Copy)]
enum CharClass {
    Whitespace,
    /// `tokenizers`' `is_punc` / `is_bert_punc`: ASCII punctuation or Unicode category P.
    Punctuation,
    Numeric,
    Is(char),
}

impl CharClass {
    fn contains(self, c: char) -> bool {
        match self {
            CharClass::Whitespace => c.is_whitespace(),
            CharClass::Punctuation => c.is_ascii_punctuation() || c.is_punctuation(),
            CharClass::Numeric => c.is_numeric(),
            CharClass::Is(x) => c == x,
        }
    }
}

enum Matcher {
    Fancy(Regex),
    Plain(regex::Regex),
    Literal(String),
    Chars(CharClass),
}

struct Step {
    matcher: Matcher,
    behavior: Behavior,
    invert: bool,
}

/// `PrependScheme` of `Metaspace`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Prepend {
    First,
    Never,
    Always,
}

/// What the last step does to each piece's text before the model sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mapping {
    Identity,
    /// Each byte becomes its GPT-2 character.
    ByteLevel,
    /// `' '` becomes `replacement`; a piece that does not start with it gets it prepended
    /// (always, or only the piece at the input's start); then split before each replacement.
    Metaspace {
        replacement: char,
        prepend: Prepend,
        split: bool,
    },
}

/// A supported pre-tokenizer: its splitting steps, then the mapping.
pub struct PreTokenizer {
    steps: Vec<Step>,
    pub mapping: Mapping,
}

/// A span of the input and whether it is a match of the pattern.
type Found = ((usize, usize), bool);

impl PreTokenizer {
    /// The pre-tokenizer serialized as `tokenizers` serializes it (`None`: no pre-tokenizer), or
    /// why the direct encoder does not cover it.
    pub fn from_json(pre: Option<&Value>) -> Result<Self, String> {
        let mut steps = Vec::new();
        let mut mapping = Mapping::Identity;
        let list: Vec<&Value> = match pre {
            None | Some(Value::Null) => Vec::new(),
            Some(v) if kind(v) == Some("Sequence") => v
                .get("pretokenizers")
                .and_then(Value::as_array)
                .ok_or("pre_tokenizer sequence without steps")?
                .iter()
                .collect(),
            Some(v) => vec![v],
        };
        for (i, step) in list.iter().enumerate() {
            if mapping != Mapping::Identity {
                return Err(format!("pre_tokenizer step after the mapping: {step}"));
            }
            let last = i + 1 == list.len();
            match kind(step) {
                Some("ByteLevel") | Some("Metaspace") if !last => {
                    return Err(format!("a mapping step before the last: {step}"))
                }
                Some("ByteLevel") => {
                    if flag(step, "add_prefix_space") != Some(false) {
                        return Err("ByteLevel adds a prefix space".into());
                    }
                    if flag(step, "use_regex").unwrap_or(true) {
                        steps.push(Step::new(
                            Matcher::Fancy(compile(BYTE_LEVEL_REGEX)?),
                            Behavior::Isolated,
                            false,
                        ));
                    }
                    mapping = Mapping::ByteLevel;
                }
                Some("Metaspace") => mapping = metaspace(step)?,
                _ => steps.extend(split_steps(step)?),
            }
        }
        Ok(PreTokenizer { steps, mapping })
    }

    /// Splits `text[start..end]` into pieces (byte ranges of `text`), appended to `out` in
    /// order; `scratch` is reused between calls.
    pub fn split(
        &self,
        text: &str,
        (start, end): (usize, usize),
        out: &mut Vec<(usize, usize)>,
        scratch: &mut Vec<(usize, usize)>,
    ) {
        scratch.clear();
        scratch.push((start, end));
        let mut found = Vec::new();
        for step in &self.steps {
            let mut next = Vec::with_capacity(scratch.len() * 2);
            for &(s, e) in scratch.iter() {
                found.clear();
                step.find(&text[s..e], &mut found);
                fold(step.behavior, &found, |(a, b)| next.push((s + a, s + b)));
            }
            *scratch = next;
        }
        out.extend_from_slice(scratch);
    }
}

impl Step {
    fn new(matcher: Matcher, behavior: Behavior, invert: bool) -> Self {
        Step {
            matcher,
            behavior,
            invert,
        }
    }

    /// Matches and gaps covering `inside`, as `tokenizers`' `Pattern::find_matches`.
    fn find(&self, inside: &str, out: &mut Vec<Found>) {
        if inside.is_empty() {
            out.push(((0, 0), false));
            return;
        }
        match &self.matcher {
            Matcher::Fancy(re) => spans(
                re.find_iter(inside)
                    .map_while(Result::ok)
                    .map(|m| (m.start(), m.end())),
                inside.len(),
                out,
            ),
            Matcher::Plain(re) => spans(
                re.find_iter(inside).map(|m| (m.start(), m.end())),
                inside.len(),
                out,
            ),
            Matcher::Literal(s) => spans(
                inside
                    .match_indices(s.as_str())
                    .map(|(at, m)| (at, at + m.len())),
                inside.len(),
                out,
            ),
            Matcher::Chars(class) => {
                let mut last = 0;
                for (b, c) in inside.char_indices() {
                    if class.contains(c) {
                        if last < b {
                            out.push(((last, b), false));
                        }
                        last = b + c.len_utf8();
                        out.push(((b, last), true));
                    }
                }
                if last < inside.len() {
                    out.push(((last, inside.len()), false));
                }
            }
        }
        if self.invert {
            for f in out.iter_mut() {
                f.1 = !f.1;
            }
        }
    }
}

/// A regex pattern's matches (`Pattern for &Regex`): every match, empty ones included, and
/// the gaps between them.
fn spans(matches: impl Iterator<Item = (usize, usize)>, len: usize, out: &mut Vec<Found>) {
    let mut prev = 0;
    for (start, end) in matches {
        if prev != start {
            out.push(((prev, start), false));
        }
        out.push(((start, end), true));
        prev = end;
    }
    if prev != len {
        out.push(((prev, len), false));
    }
}

/// `NormalizedString::split`'s rules: which spans become pieces (empty pieces dropped, as
/// `PreTokenizedString::split` drops them).
fn fold(behavior: Behavior, found: &[Found], mut emit: impl FnMut((usize, usize))) {
    let mut kept: Vec<(usize, usize)> = Vec::with_capacity(found.len());
    match behavior {
        Behavior::Isolated => kept.extend(found.iter().map(|f| f.0)),
        Behavior::Removed => kept.extend(found.iter().filter(|f| !f.1).map(|f| f.0)),
        Behavior::Contiguous => {
            let mut previous = false;
            for &(span, is_match) in found {
                match kept.last_mut() {
                    Some(last) if is_match == previous => last.1 = span.1,
                    _ => kept.push(span),
                }
                previous = is_match;
            }
        }
        Behavior::MergedWithPrevious => {
            let mut previous = false;
            for &(span, is_match) in found {
                match kept.last_mut() {
                    Some(last) if is_match && !previous => last.1 = span.1,
                    _ => kept.push(span),
                }
                previous = is_match;
            }
        }
        Behavior::MergedWithNext => {
            let mut previous = false;
            for &(span, is_match) in found.iter().rev() {
                match kept.last_mut() {
                    Some(last) if is_match && !previous => last.0 = span.0,
                    _ => kept.push(span),
                }
                previous = is_match;
            }
            kept.reverse();
        }
    }
    for span in kept {
        if span.1 > span.0 {
            emit(span);
        }
    }
}

fn kind(v: &Value) -> Option<&str> {
    v.get("type").and_then(Value::as_str)
}

fn flag(v: &Value, name: &str) -> Option<bool> {
    v.get(name).and_then(Value::as_bool)
}

fn compile(source: &str) -> Result<Regex, String> {
    Regex::new(source).map_err(|e| e.to_string())
}

fn behavior(v: &Value) -> Result<Behavior, String> {
    Ok(match v.get("behavior").and_then(Value::as_str) {
        Some("Removed") => Behavior::Removed,
        Some("Isolated") => Behavior::Isolated,
        Some("MergedWithPrevious") => Behavior::MergedWithPrevious,
        Some("MergedWithNext") => Behavior::MergedWithNext,
        Some("Contiguous") => Behavior::Contiguous,
        other => return Err(format!("unknown split behavior {other:?}")),
    })
}

/// The steps of one non-mapping pre-tokenizer.
fn split_steps(step: &Value) -> Result<Vec<Step>, String> {
    let chars = |class, behavior| Step::new(Matcher::Chars(class), behavior, false);
    Ok(match kind(step) {
        Some("Split") => {
            let pattern = step.get("pattern").ok_or("Split without pattern")?;
            let matcher = if let Some(r) = pattern.get("Regex").and_then(Value::as_str) {
                Matcher::Fancy(compile(r)?)
            } else if let Some(s) = pattern.get("String").and_then(Value::as_str) {
                if s.is_empty() {
                    Matcher::Fancy(compile("")?)
                } else {
                    Matcher::Literal(s.to_string())
                }
            } else {
                return Err("Split pattern is neither Regex nor String".into());
            };
            let invert = flag(step, "invert").ok_or("Split without invert")?;
            vec![Step::new(matcher, behavior(step)?, invert)]
        }
        Some("Whitespace") => {
            let re = regex::Regex::new(WHITESPACE_REGEX).map_err(|e| e.to_string())?;
            vec![Step::new(Matcher::Plain(re), Behavior::Removed, true)]
        }
        Some("WhitespaceSplit") => vec![chars(CharClass::Whitespace, Behavior::Removed)],
        Some("Punctuation") => vec![chars(CharClass::Punctuation, behavior(step)?)],
        Some("Digits") => {
            let individual = flag(step, "individual_digits").unwrap_or(false);
            let how = if individual {
                Behavior::Isolated
            } else {
                Behavior::Contiguous
            };
            vec![chars(CharClass::Numeric, how)]
        }
        Some("BertPreTokenizer") => vec![
            chars(CharClass::Whitespace, Behavior::Removed),
            chars(CharClass::Punctuation, Behavior::Isolated),
        ],
        Some("CharDelimiterSplit") => {
            let delimiter = step
                .get("delimiter")
                .and_then(Value::as_str)
                .and_then(|s| {
                    let mut c = s.chars();
                    c.next().filter(|_| c.next().is_none())
                })
                .ok_or("CharDelimiterSplit without a one-character delimiter")?;
            vec![chars(CharClass::Is(delimiter), Behavior::Removed)]
        }
        other => return Err(format!("unsupported pre_tokenizer {other:?}")),
    })
}

fn metaspace(step: &Value) -> Result<Mapping, String> {
    let replacement = step
        .get("replacement")
        .and_then(Value::as_str)
        .and_then(|s| {
            let mut c = s.chars();
            c.next().filter(|_| c.next().is_none())
        })
        .ok_or("Metaspace without a one-character replacement")?;
    let prepend = match step.get("prepend_scheme").and_then(Value::as_str) {
        Some("first") => Prepend::First,
        Some("never") => Prepend::Never,
        Some("always") => Prepend::Always,
        other => return Err(format!("Metaspace prepend_scheme {other:?}")),
    };
    let split = flag(step, "split").ok_or("Metaspace without split")?;
    Ok(Mapping::Metaspace {
        replacement,
        prepend,
        split,
    })
}

/// `text[start..end]` as the model sees it after a [`Mapping::Metaspace`], with the input byte
/// each of its bytes came from (`origin[i]`, plus the end), and the sub-pieces (ranges of the
/// mapped text) the model tokenizes.
pub fn metaspace_map(
    text: &str,
    (start, end): (usize, usize),
    (replacement, prepend, split): (char, Prepend, bool),
    mapped: &mut String,
    origin: &mut Vec<u32>,
    pieces: &mut Vec<(usize, usize)>,
) {
    mapped.clear();
    origin.clear();
    pieces.clear();
    let piece = &text[start..end];
    let starts_replaced = piece.starts_with(' ') || piece.starts_with(replacement);
    let prepend = match prepend {
        Prepend::Always => !starts_replaced,
        Prepend::First => !starts_replaced && start == 0,
        Prepend::Never => false,
    };
    let mut push = |c: char, from: usize, mapped: &mut String| {
        for _ in 0..c.len_utf8() {
            origin.push(from as u32);
        }
        mapped.push(c);
    };
    if prepend {
        push(replacement, start, mapped);
    }
    for (at, c) in piece.char_indices() {
        push(if c == ' ' { replacement } else { c }, start + at, mapped);
    }
    origin.push(end as u32);
    if !split {
        pieces.push((0, mapped.len()));
        return;
    }
    let step = Step::new(
        Matcher::Chars(CharClass::Is(replacement)),
        Behavior::MergedWithNext,
        false,
    );
    let mut found = Vec::new();
    step.find(mapped, &mut found);
    fold(step.behavior, &found, |span| pieces.push(span));
}

#[cfg(test)]
#[path = "pretok_tests.rs"]
mod tests;
