//! Where a cached tokenization may be resumed (ARCHITECTURE.md §8): the restart rules, the
//! checkpoints cut for them, the restart search, and the load-time self-check that decides
//! which rules hold for a tokenizer. `tokenize::prefix_cache` uses them; this module knows
//! nothing about the cache itself, requests or models.
//!
//! A restart point is a token boundary of a cached tokenization, strictly inside the prefix a
//! new text shares with the cached one, where the pre-tokenizer always splits and decides that
//! split from the characters around it: the tokens before it are then the same in the new text
//! and the tokens after it are the tokenization of the rest alone. Which boundaries have that
//! property depends on the pre-tokenizer, so there are three rules:
//!
//! - [`Rule::LineStart`]: a token starting right after a `\n`, with a non-whitespace first
//!   character, contiguous with the previous token (byte-level BPE regexes: GPT-2, cl100k,
//!   Llama 3, DeepSeek, Qwen);
//! - [`Rule::WordStart`]: a token starting right after a space, with a non-whitespace first
//!   character, only whitespace between it and the previous token (pre-tokenizers that split
//!   after or drop spaces: `Split(" ", MergedWithPrevious)`, `Whitespace`, `WhitespaceSplit`,
//!   BERT's);
//! - [`Rule::SpaceStart`]: a token starting at a space that follows and precedes non-whitespace,
//!   contiguous with the previous token (pre-tokenizers that attach a space to the next word:
//!   `Metaspace`, GPT-2's ` ?\p{L}+`).
//!
//! A rule is used for a tokenizer only if, on probe texts, every boundary it finds passes the
//! check (the rest tokenized alone equals the tail, and the shortest shared prefixes past it
//! tokenize to the same head) and it finds enough of them to mean something.

use xxhash_rust::xxh3::Xxh3;

/// Minimum distance between two checkpoints, in bytes.
pub const CHUNK: usize = 2048;
/// How far back from the shared prefix's end a restart point is searched, in tokens.
const MAX_BACKOFF_TOKENS: usize = 4096;
/// A rule is accepted only after this many restart points passed the self-check.
const MIN_CHECKED: usize = 4;

/// One kind of restart point (module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rule {
    LineStart,
    WordStart,
    SpaceStart,
}

impl Rule {
    pub const ALL: [Rule; 3] = [Rule::LineStart, Rule::WordStart, Rule::SpaceStart];

    fn bit(self) -> u8 {
        match self {
            Rule::LineStart => 1,
            Rule::WordStart => 2,
            Rule::SpaceStart => 4,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Rule::LineStart => "line_start",
            Rule::WordStart => "word_start",
            Rule::SpaceStart => "space_start",
        }
    }

    /// Whether `text[..at]` ends where this rule's restart points lie (one byte of look-ahead).
    fn cuts(self, bytes: &[u8], at: usize) -> bool {
        match self {
            Rule::LineStart => bytes[at - 1] == b'\n',
            Rule::WordStart => bytes[at - 1] == b' ',
            Rule::SpaceStart => bytes[at] == b' ',
        }
    }

    /// Whether token `i` (starting at `starts[i]`) is a restart point for a text sharing
    /// `text[..len]`.
    fn restarts(self, tokens: &Tokens<'_>, i: usize, len: usize) -> bool {
        let text = tokens.text.as_bytes();
        let start = tokens.starts[i] as usize;
        let previous_end = tokens.ends[i - 1] as usize;
        let ws = |at: usize| text[at].is_ascii_whitespace();
        match self {
            Rule::LineStart => previous_end == start && text[start - 1] == b'\n' && !ws(start),
            Rule::WordStart => {
                text[start - 1] == b' '
                    && !ws(start)
                    && previous_end <= start
                    && text[previous_end..start]
                        .iter()
                        .all(u8::is_ascii_whitespace)
            }
            Rule::SpaceStart => {
                previous_end == start
                    && text[start] == b' '
                    && !ws(start - 1)
                    && start + 1 < len
                    && !ws(start + 1)
            }
        }
    }
}

/// A set of rules.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Rules(u8);

impl Rules {
    pub fn contains(self, rule: Rule) -> bool {
        self.0 & rule.bit() != 0
    }

    pub fn with(self, rule: Rule) -> Rules {
        Rules(self.0 | rule.bit())
    }

    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    pub fn iter(self) -> impl Iterator<Item = Rule> {
        Rule::ALL.into_iter().filter(move |r| self.contains(*r))
    }

    pub fn names(self) -> Vec<&'static str> {
        self.iter().map(Rule::name).collect()
    }
}

/// A tokenized text: the text and, per token, its byte span.
pub struct Tokens<'a> {
    pub text: &'a str,
    pub starts: &'a [u32],
    pub ends: &'a [u32],
}

/// Checkpoints of `text` for `rules`: (length, xxh3 of `text[..length]`), left to right, each
/// the first cut of any rule at least [`CHUNK`] bytes after the previous one. Chosen from the
/// text alone (plus one byte after the cut), so two texts sharing a prefix share every
/// checkpoint inside it.
pub fn checkpoints(text: &str, rules: Rules) -> Vec<(usize, u64)> {
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    if rules.is_empty() {
        return out;
    }
    let mut hasher = Xxh3::new();
    let (mut hashed, mut last) = (0, 0);
    loop {
        let from = last + CHUNK;
        let Some(cut) = (from..bytes.len()).find(|&at| rules.iter().any(|r| r.cuts(bytes, at)))
        else {
            break;
        };
        hasher.update(&bytes[hashed..cut]);
        hashed = cut;
        out.push((cut, hasher.digest()));
        last = cut;
    }
    out
}

/// Index of the last token that is a restart point of any of `rules` for a text sharing
/// `tokens.text[..len]` (which may extend to the text's own end).
pub fn restart_token(tokens: &Tokens<'_>, len: usize, rules: Rules) -> Option<usize> {
    let upper = tokens.starts.partition_point(|&s| (s as usize) < len);
    let lower = upper.saturating_sub(MAX_BACKOFF_TOKENS).max(1);
    (lower..upper).rev().find(|&i| {
        let start = tokens.starts[i] as usize;
        // The first token starting there: a zero-width token before it at the same position (a
        // prepended `▁`) belongs to the rest, not to the kept head.
        start > 0
            && start < len
            && (tokens.starts[i - 1] as usize) < start
            && tokens.text.is_char_boundary(start)
            && rules.iter().any(|r| r.restarts(tokens, i, len))
    })
}

/// Ids and byte spans of a text, as the tokenizer under check produces them.
pub struct Encoding {
    pub ids: Vec<u32>,
    pub starts: Vec<u32>,
    pub ends: Vec<u32>,
}

/// Texts the self-check probes: line starts, word runs, whitespace runs, numbers, unicode,
/// code, chat markup and a long line of four-byte words (the sim's text form).
const PROBES: [&str; 9] = [
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHello  world!\n\n  indented 12345 tokens\nDone.",
    "first line\nsecond line with   spaces   \nthird: 3.14159 and ünïcödé 漢字 テスト\n{\"a\": [1, 2]}\nend",
    "def f(x):\n    return x  \n\n\nclass A:\n\tpass\n# comment\n",
    "a\nb\nc\n.\n,\n'\n\"quoted\"\n",
    "The quick brown fox, it's said, jumps over 13 lazy dogs; don't you think? Yes -- 2.5x faster!",
    "abc def ghi jkl mno pqr stu vwx yza bcd efg hij klm nop qrs tuv wxy zab cde fgh ijk lmn ",
    "数据 结构 and テスト 12 345 6789 x_y a-b (paren) [bracket] {brace} \"quote\" 'single' end",
    "tabs\tand  double  spaces   triple   and\u{a0}nbsp then a\n line\n\n two blank\nlast",
    "the answer the answer café café assistant assistant don't I'll 😀 😀 x=1; x=1; -- done",
];

/// The rules that hold for the tokenizer `encode` stands for (module docs).
pub fn accepted_rules(encode: impl Fn(&str) -> Option<Encoding>) -> Rules {
    let mut rules = Rules::default();
    let mut wholes = Vec::new();
    for probe in PROBES {
        let Some(whole) = encode(probe) else {
            return rules;
        };
        wholes.push((probe, whole));
    }
    for rule in Rule::ALL {
        if let Some(checked) = check_rule(rule, &wholes, &encode) {
            if checked >= MIN_CHECKED {
                rules = rules.with(rule);
            }
        }
    }
    rules
}

/// How many restart points of `rule` passed on the probes; `None` if one failed.
fn check_rule(
    rule: Rule,
    wholes: &[(&str, Encoding)],
    encode: &impl Fn(&str) -> Option<Encoding>,
) -> Option<usize> {
    let only = Rules::default().with(rule);
    let mut checked = 0;
    for (probe, whole) in wholes {
        let tokens = Tokens {
            text: probe,
            starts: &whole.starts,
            ends: &whole.ends,
        };
        for i in 1..whole.ids.len() {
            let start = whole.starts[i] as usize;
            // The shortest shared prefixes that make token i a restart point: the ones whose
            // look-ahead past it is least.
            let lens: Vec<usize> = (start + 1..=probe.len())
                .filter(|&len| probe.is_char_boundary(len))
                .take(3)
                .filter(|&len| restart_token(&tokens, len, only) == Some(i))
                .collect();
            if lens.is_empty() {
                continue;
            }
            let tail = encode(&probe[start..])?;
            if tail.ids != whole.ids[i..] {
                return None;
            }
            for len in lens {
                let head = encode(&probe[..len])?;
                if head.ids.get(..i) != Some(&whole.ids[..i]) {
                    return None;
                }
            }
            checked += 1;
        }
    }
    Some(checked)
}

#[cfg(test)]
#[path = "boundary_tests.rs"]
mod tests;
