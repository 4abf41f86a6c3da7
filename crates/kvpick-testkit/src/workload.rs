//! The content the scale benchmark's engines cache and its requests ask for: prompt families
//! (shared prefixes, as system prompts and documents are shared in real traffic) whose token ids
//! both the simulated KV-event publishers and the pick client derive from the same function, so
//! picks find the blocks the events stored.
//!
//! Pure values: no sockets, no clocks.

/// The shape of the shared content.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Workload {
    /// Distinct shared prefixes.
    pub families: u32,
    /// Blocks of one family's prefix.
    pub family_blocks: u32,
    /// Tokens per KV block (the engines' `--block-size`, annotated on the pods).
    pub block_size: u32,
    /// Tokens of one request's prompt: its family's prefix, then tokens of its own.
    pub prompt_tokens: u32,
}

impl Workload {
    /// Tokens of a family's shared prefix.
    pub fn prefix_tokens(&self) -> u32 {
        self.family_blocks.saturating_mul(self.block_size)
    }

    /// The token ids of blocks `first .. first + count` of `family`'s prefix.
    pub fn family_tokens(&self, family: u32, first: u32, count: u32) -> Vec<u32> {
        let start = first.saturating_mul(self.block_size);
        let end = first.saturating_add(count).saturating_mul(self.block_size);
        (start..end)
            .map(|position| token(u64::from(family), u64::from(position)))
            .collect()
    }

    /// Request `n`'s prompt: family `n % families`'s whole prefix, then tokens only it has.
    pub fn prompt(&self, n: u64) -> Vec<u32> {
        let family = (n % u64::from(self.families.max(1))) as u32;
        let mut tokens = self.family_tokens(family, 0, self.family_blocks);
        let own = self.prompt_tokens.saturating_sub(self.prefix_tokens());
        // Family ids stay below 2^32; a request's own stream starts above them.
        let stream = (1u64 << 32) + n;
        tokens.extend((0..u64::from(own)).map(|position| token(stream, position)));
        tokens.truncate(self.prompt_tokens as usize);
        tokens
    }

    /// A `/v1/completions` body whose prompt is request `n`'s token ids.
    pub fn completion_body(&self, model: &str, n: u64) -> Vec<u8> {
        let prompt = self.prompt(n);
        let mut body = String::with_capacity(prompt.len() * 7 + 64);
        body.push_str("{\"model\":\"");
        body.push_str(model);
        body.push_str("\",\"max_tokens\":1,\"prompt\":[");
        for (i, t) in prompt.iter().enumerate() {
            if i > 0 {
                body.push(',');
            }
            body.push_str(&t.to_string());
        }
        body.push_str("]}");
        body.into_bytes()
    }
}

/// Token id at `position` of stream `stream`: spread over a 128k vocabulary, never 0.
fn token(stream: u64, position: u64) -> u32 {
    let mixed = stream
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(position.wrapping_mul(0xC2B2_AE3D_27D4_EB4F));
    ((mixed >> 33) % 128_000) as u32 + 1
}

#[cfg(test)]
mod tests {
    use super::*;

    const W: Workload = Workload {
        families: 4,
        family_blocks: 2,
        block_size: 16,
        prompt_tokens: 48,
    };

    #[test]
    fn prompts_share_their_familys_prefix_and_nothing_after_it() {
        let a = W.prompt(1);
        let b = W.prompt(5);
        let c = W.prompt(2);
        assert_eq!(a.len(), 48);
        assert_eq!(a[..32], b[..32], "same family");
        assert_ne!(a[32..], b[32..], "each request's own tokens");
        assert_ne!(a[..16], c[..16], "another family");
        assert_eq!(
            a[16..32],
            W.family_tokens(1, 1, 1)[..],
            "block 1 of family 1"
        );
    }

    #[test]
    fn the_body_is_json_with_the_prompt_as_token_ids() {
        let body: serde_json::Value = serde_json::from_slice(&W.completion_body("m", 3)).unwrap();
        assert_eq!(body["model"], "m");
        let ids: Vec<u32> = serde_json::from_value(body["prompt"].clone()).unwrap();
        assert_eq!(ids, W.prompt(3));
    }

    #[test]
    fn a_prompt_shorter_than_the_prefix_is_cut() {
        let short = Workload {
            prompt_tokens: 20,
            ..W
        };
        assert_eq!(short.prompt(0).len(), 20);
    }
}
