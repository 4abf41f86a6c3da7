//! Block hashing of token ids (ARCHITECTURE.md §7), shared by requests and KV events so both sides key the
//! index identically: `local_hash` per complete block (xxh3-64 over u32 little-endian tokens,
//! seed 1337 salted by LoRA name and cache salt; a block holding an image's placeholder tokens has
//! the image's `(identifier, offset)` keys folded in, as vLLM's `extra_keys` key it), chained into
//! position-aware `seq_hash`es.

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

pub const BASE_SEED: u64 = 1337;

/// The seed of a block's hash: 1337, salted by LoRA adapter (every block) and `cache_salt` (the
/// first block of a prompt only, as vLLM mixes it into the first block's `extra_keys`; the chain
/// carries it to every later block).
pub fn block_seed(lora_name: Option<&str>, cache_salt: Option<&str>) -> u64 {
    let mut seed = BASE_SEED;
    if let Some(lora) = lora_name {
        seed = seed.wrapping_add(xxh3_64_with_seed(lora.as_bytes(), 0));
    }
    if let Some(salt) = cache_salt {
        seed = seed.wrapping_add(xxh3_64_with_seed(salt.as_bytes(), 1));
    }
    seed
}

/// Hash of one block of tokens (u32 little-endian). On a little-endian machine the tokens' memory
/// is those bytes, so they are hashed in place; elsewhere they are copied out first.
pub fn block_hash(block: &[u32], seed: u64) -> u64 {
    #[cfg(target_endian = "little")]
    {
        xxh3_64_with_seed(zerocopy::IntoBytes::as_bytes(block), seed)
    }
    #[cfg(not(target_endian = "little"))]
    {
        let bytes: Vec<u8> = block.iter().flat_map(|t| t.to_le_bytes()).collect();
        xxh3_64_with_seed(&bytes, seed)
    }
}

/// Hashes of every complete block of `tokens` (a partial tail is not hashed).
pub fn local_hashes(tokens: &[u32], block_size: usize, seed: u64) -> Vec<u64> {
    tokens
        .chunks_exact(block_size)
        .map(|block| block_hash(block, seed))
        .collect()
}

/// Chains local hashes so equal blocks at different prefixes never alias:
/// `seq[0] = local[0]`, `seq[i] = xxh3(seq[i-1] ‖ local[i], 1337)`.
pub fn sequence_hashes(local: &[u64]) -> Vec<u64> {
    chained(local.to_vec())
}

/// [`sequence_hashes`] in place, for a list of local hashes the caller no longer needs.
fn chained(mut local: Vec<u64>) -> Vec<u64> {
    for i in 1..local.len() {
        local[i] = chain(local[i - 1], local[i]);
    }
    local
}

/// One chaining step.
pub fn chain(parent: u64, local: u64) -> u64 {
    let mut buf = [0u8; 16];
    buf[..8].copy_from_slice(&parent.to_le_bytes());
    buf[8..].copy_from_slice(&local.to_le_bytes());
    xxh3_64_with_seed(&buf, BASE_SEED)
}

/// Sequence hashes of a token prompt in one call.
pub fn prompt_hashes(tokens: &[u32], block_size: usize, seed: u64) -> Vec<u64> {
    chained(local_hashes(tokens, block_size, seed))
}

/// `seed` with a `cache_salt` mixed in, for a prompt's first block.
pub fn salted(seed: u64, cache_salt: Option<&str>) -> u64 {
    match cache_salt {
        Some(salt) => seed.wrapping_add(xxh3_64_with_seed(salt.as_bytes(), 1)),
        None => seed,
    }
}

/// Sequence hashes of a prompt whose first block carries `cache_salt` (every block `seed`).
pub fn salted_prompt_hashes(
    tokens: &[u32],
    block_size: usize,
    seed: u64,
    cache_salt: Option<&str>,
) -> Vec<u64> {
    let mut local = local_hashes(tokens, block_size, seed);
    if let (Some(first), Some(block)) = (local.first_mut(), tokens.get(..block_size)) {
        if cache_salt.is_some() {
            *first = block_hash(block, salted(seed, cache_salt));
        }
    }
    chained(local)
}

/// Text as the 4-byte pseudo-tokens kvpick hashes when it has no tokenizer (u32 little-endian
/// words, the last one zero-padded): the definition [`salted_text_hashes`] hashes without
/// building the list, and the tokenizer of the simulated workers.
pub fn pseudo_tokens(bytes: &[u8]) -> Vec<u32> {
    bytes
        .chunks(4)
        .map(|c| {
            let mut word = [0u8; 4];
            word[..c.len()].copy_from_slice(c);
            u32::from_le_bytes(word)
        })
        .collect()
}

/// Sequence hashes of text without a tokenizer, read as 4-byte pseudo-tokens (u32 little-endian,
/// the last one zero-padded): the same hashes as [`salted_prompt_hashes`] over those tokens, but
/// hashed straight from the bytes, since a block's pseudo-tokens in little-endian *are* its bytes.
/// Saves copying the whole prompt into a token list first.
pub fn salted_text_hashes(
    bytes: &[u8],
    block_size: usize,
    seed: u64,
    cache_salt: Option<&str>,
) -> Vec<u64> {
    if block_size == 0 {
        return Vec::new();
    }
    let block_bytes = block_size.saturating_mul(4);
    let blocks = bytes.len().div_ceil(4) / block_size;
    let mut local = Vec::with_capacity(blocks);
    for (k, chunk) in bytes.chunks(block_bytes).take(blocks).enumerate() {
        let seed = if k == 0 {
            salted(seed, cache_salt)
        } else {
            seed
        };
        if chunk.len() == block_bytes {
            local.push(xxh3_64_with_seed(chunk, seed));
        } else {
            // Only the last complete block can end inside a pseudo-token: pad that one.
            let mut padded = chunk.to_vec();
            padded.resize(block_bytes, 0);
            local.push(xxh3_64_with_seed(&padded, seed));
        }
    }
    chained(local)
}

/// One multimodal item of a prompt (an image, say) as vLLM places it: its identifier folded to
/// 64 bits ([`media_id`]) and the placeholder tokens it occupies, `[offset, offset + length)`
/// (vLLM's `mm_position`). A prompt's spans are sorted by offset and do not overlap.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MediaSpan {
    pub id: u64,
    pub offset: u64,
    pub length: u64,
}

/// One `(identifier, offset)` key of a block, as vLLM's `_gen_mm_extra_hash_keys` makes it: the
/// item's start relative to the block's first token (negative when the item began in an earlier
/// block).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MediaKey {
    pub id: u64,
    pub offset: i64,
}

/// A multimodal identifier (vLLM's `mm_hash` or a client's uuid, as a string) as 64 bits. Seeded
/// apart from every other use of xxh3 here so an identifier never equals a text id.
pub fn media_id(identifier: &str) -> u64 {
    xxh3_64_with_seed(identifier.as_bytes(), MEDIA_SEED)
}

const MEDIA_SEED: u64 = 0x6d6d_5f6b_6579; // "mm_key"

/// The media keys of the block `[start, end)`, in vLLM's order: every span that overlaps it,
/// with its offset relative to `start` (vLLM's `_gen_mm_extra_hash_keys`).
pub fn block_media_keys(spans: &[MediaSpan], start: u64, end: u64) -> Vec<MediaKey> {
    spans
        .iter()
        .filter(|s| end > s.offset && start < s.offset.saturating_add(s.length))
        .map(|s| MediaKey {
            id: s.id,
            offset: (s.offset as i64).wrapping_sub(start as i64),
        })
        .collect()
}

/// A block's local hash with its media keys folded in, in order. No keys: `local` unchanged, so
/// text-only blocks hash as they always did, on both sides.
pub fn fold_media(local: u64, keys: &[MediaKey]) -> u64 {
    keys.iter().fold(local, |acc, key| {
        let mut buf = [0u8; 24];
        buf[..8].copy_from_slice(&acc.to_le_bytes());
        buf[8..16].copy_from_slice(&key.id.to_le_bytes());
        buf[16..].copy_from_slice(&key.offset.to_le_bytes());
        xxh3_64_with_seed(&buf, MEDIA_SEED)
    })
}

/// [`salted_prompt_hashes`] of a prompt with multimodal items: each block overlapping a span has
/// that span's key folded into its local hash (before chaining), as a KV event's `extra_keys` for
/// the same block fold on the event side. Blocks past every span hash as text; the chain carries
/// an image's identity to every later block (prefix semantics).
pub fn media_prompt_hashes(
    tokens: &[u32],
    block_size: usize,
    seed: u64,
    cache_salt: Option<&str>,
    spans: &[MediaSpan],
) -> Vec<u64> {
    if block_size == 0 {
        return Vec::new();
    }
    let mut local = local_hashes(tokens, block_size, seed);
    if let (Some(first), Some(block)) = (local.first_mut(), tokens.get(..block_size)) {
        if cache_salt.is_some() {
            *first = block_hash(block, salted(seed, cache_salt));
        }
    }
    let bs = block_size as u64;
    for (i, h) in local.iter_mut().enumerate() {
        let start = (i as u64).saturating_mul(bs);
        let keys = block_media_keys(spans, start, start.saturating_add(bs));
        *h = fold_media(*h, &keys);
    }
    chained(local)
}

/// A well-mixed 64-bit value of `n` (test data: keys the way chained hashes look).
#[cfg(test)]
pub(crate) fn text_id_u64(n: u64) -> u64 {
    xxh3_64(&n.to_le_bytes())
}

/// A stable 64-bit id for a text fragment (used where no token ids exist).
pub fn text_id(bytes: &[u8]) -> u64 {
    xxh3_64(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_hash_matches_the_byte_definition() {
        for len in [1usize, 16, 64, 65, 200] {
            let block: Vec<u32> = (0..len as u32)
                .map(|t| t.wrapping_mul(0x9E37_79B9))
                .collect();
            let bytes: Vec<u8> = block.iter().flat_map(|t| t.to_le_bytes()).collect();
            assert_eq!(block_hash(&block, 7), xxh3_64_with_seed(&bytes, 7), "{len}");
        }
    }

    #[test]
    fn chaining_in_place_is_sequence_hashes() {
        for len in [0u64, 1, 2, 3, 50] {
            let local: Vec<u64> = (0..len).map(text_id_u64).collect();
            // The definition, step by step.
            let mut by_definition: Vec<u64> = Vec::new();
            for &h in &local {
                let next = by_definition.last().map_or(h, |&p| chain(p, h));
                by_definition.push(next);
            }
            assert_eq!(chained(local.clone()), by_definition, "{len}");
            assert_eq!(sequence_hashes(&local), by_definition, "{len}");
        }
        let tokens: Vec<u32> = (0..100).collect();
        assert_eq!(
            prompt_hashes(&tokens, 16, BASE_SEED),
            sequence_hashes(&local_hashes(&tokens, 16, BASE_SEED))
        );
    }

    #[test]
    fn text_hashed_from_its_bytes_equals_text_hashed_as_pseudo_tokens() {
        let text: Vec<u8> = (0..1_100u32)
            .map(|i| (i.wrapping_mul(31) % 251) as u8)
            .collect();
        // Block sizes on both sides of block_hash's 64-token stack buffer; lengths ending inside
        // a pseudo-token just under, at and over a block boundary.
        for block_size in [1usize, 3, 16, 64, 65] {
            let boundary = block_size * 4 * 4;
            let lengths = [
                0,
                1,
                5,
                boundary - 5,
                boundary - 4,
                boundary - 1,
                boundary,
                boundary + 1,
            ];
            for len in lengths.into_iter().chain((0..text.len()).step_by(37)) {
                let bytes = &text[..len.min(text.len())];
                for salt in [None, Some("s")] {
                    assert_eq!(
                        salted_text_hashes(bytes, block_size, 9, salt),
                        salted_prompt_hashes(&pseudo_tokens(bytes), block_size, 9, salt),
                        "block size {block_size}, {len} bytes, salt {salt:?}"
                    );
                }
            }
        }
        assert!(salted_text_hashes(&text, 0, 9, None).is_empty());
    }

    #[test]
    fn media_keys_follow_vllms_block_overlap_rule() {
        let img = MediaSpan {
            id: media_id("img"),
            offset: 10,
            length: 40,
        };
        // Blocks of 16: [0,16) holds the start at +10, [16,32) and [32,48) hold it from before
        // (-6, -22), [48,64) holds its last two tokens (-38), [64,80) is past it.
        let offsets: Vec<Vec<i64>> = (0..5u64)
            .map(|b| {
                block_media_keys(&[img], b * 16, b * 16 + 16)
                    .iter()
                    .map(|k| k.offset)
                    .collect()
            })
            .collect();
        assert_eq!(
            offsets,
            vec![vec![10], vec![-6], vec![-22], vec![-38], vec![]]
        );
    }

    #[test]
    fn the_same_image_at_another_offset_in_identical_blocks_is_another_key() {
        // Block 1 is all placeholder tokens either way; only where the image began differs.
        let key = |offset| MediaKey {
            id: media_id("img"),
            offset,
        };
        let block = block_hash(&[9; 16], BASE_SEED);
        assert_ne!(fold_media(block, &[key(-6)]), fold_media(block, &[key(-4)]));
        assert_ne!(fold_media(block, &[key(-6)]), block);
        // Order matters, as in vLLM's tuple.
        let other = MediaKey {
            id: media_id("other"),
            offset: 3,
        };
        assert_ne!(
            fold_media(block, &[key(-6), other]),
            fold_media(block, &[other, key(-6)])
        );
    }

    #[test]
    fn media_changes_the_blocks_it_occupies_and_everything_after() {
        let tokens: Vec<u32> = (0..96).map(|t| t % 7).collect();
        let span = |id: &str| MediaSpan {
            id: media_id(id),
            offset: 20,
            length: 20,
        };
        let plain = salted_prompt_hashes(&tokens, 16, 9, None);
        let a = media_prompt_hashes(&tokens, 16, 9, None, &[span("a")]);
        let b = media_prompt_hashes(&tokens, 16, 9, None, &[span("b")]);
        assert_eq!(media_prompt_hashes(&tokens, 16, 9, None, &[]), plain);
        // Block 0 ends before the image: shared by all three.
        assert_eq!((a[0], b[0]), (plain[0], plain[0]));
        for i in 1..a.len() {
            assert_ne!(a[i], b[i], "block {i}");
            assert_ne!(a[i], plain[i], "block {i}");
        }
        assert_eq!(
            media_prompt_hashes(&tokens, 16, 9, Some("s"), &[span("a")])[0],
            salted_prompt_hashes(&tokens, 16, 9, Some("s"))[0]
        );
    }

    #[test]
    fn partial_tail_is_not_hashed() {
        let tokens: Vec<u32> = (0..40).collect();
        assert_eq!(local_hashes(&tokens, 16, BASE_SEED).len(), 2);
    }

    #[test]
    fn equal_blocks_at_different_prefixes_differ() {
        let a: Vec<u32> = [vec![1; 16], vec![7; 16]].concat();
        let b: Vec<u32> = [vec![2; 16], vec![7; 16]].concat();
        let (ha, hb) = (
            prompt_hashes(&a, 16, BASE_SEED),
            prompt_hashes(&b, 16, BASE_SEED),
        );
        assert_ne!(ha[1], hb[1]);
        let la = local_hashes(&a, 16, BASE_SEED);
        let lb = local_hashes(&b, 16, BASE_SEED);
        assert_eq!(la[1], lb[1], "local hashes only see the block");
    }

    #[test]
    fn salts_change_every_hash_and_shared_prefixes_share_hashes() {
        let t: Vec<u32> = (0..64).collect();
        let plain = prompt_hashes(&t, 16, block_seed(None, None));
        assert_ne!(
            plain[0],
            prompt_hashes(&t, 16, block_seed(Some("lora"), None))[0]
        );
        assert_ne!(
            plain[0],
            prompt_hashes(&t, 16, block_seed(None, Some("salt")))[0]
        );
        let longer: Vec<u32> = (0..96).collect();
        assert_eq!(&prompt_hashes(&longer, 16, BASE_SEED)[..4], &plain[..]);
        assert_eq!(block_seed(None, None), BASE_SEED);
    }
}
