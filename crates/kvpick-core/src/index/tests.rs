//! The KV index's tests: prefix matches per rank and tier against a naive definition and a plain
//! model, expiry and purging, clearing ranks, LRU eviction (sampled and by shard), shard growth and
//! the entry layout.

use super::*;
use std::time::Duration;

fn matches(idx: &PrefixIndex, hashes: &[u64], now: Instant) -> HashMap<RankKey, TierDepths> {
    idx.find_matches(hashes, now).into_iter().collect()
}

fn rank(w: u64) -> RankKey {
    RankKey {
        worker_id: w,
        dp_rank: 0,
    }
}

#[test]
fn longest_consecutive_prefix_per_rank_and_tier() {
    let mut idx = PrefixIndex::new(1000, Instant::now());
    let now = Instant::now();
    idx.insert(rank(1), &[10, 11, 12, 13], Tier::Gpu, None);
    idx.insert(rank(2), &[10, 11], Tier::Gpu, None);
    idx.insert(rank(2), &[12, 13], Tier::Host, None);
    idx.insert(rank(3), &[10, 12, 13], Tier::Gpu, None); // hole at 11
    let m = matches(&idx, &[10, 11, 12, 13, 14], now);
    assert_eq!(
        m[&rank(1)],
        TierDepths {
            gpu: 4,
            host: 4,
            disk: 4
        }
    );
    assert_eq!(
        m[&rank(2)],
        TierDepths {
            gpu: 2,
            host: 4,
            disk: 4
        }
    );
    assert_eq!(
        m[&rank(3)],
        TierDepths {
            gpu: 1,
            host: 1,
            disk: 1
        }
    );
    assert!(
        matches(&idx, &[99, 10], now).is_empty(),
        "no match at block 0"
    );
}

/// A block's holders as (rank, holder), whichever way they are stored.
fn holders(idx: &PrefixIndex, h: u64) -> Vec<(RankKey, Holder)> {
    let Some(entry) = idx.blocks.get(&BlockKey::new(h)) else {
        return vec![];
    };
    let list = match entry.holder.who {
        MULTI => idx.slab[entry.multi() as usize].holders.clone(),
        _ => vec![entry.holder],
    };
    list.into_iter()
        .filter(|x| !retired(&idx.ranks, x.rank_id()))
        .map(|x| (idx.rank_of(x.rank_id()), x))
        .collect()
}

/// The obvious definition, block by block, for comparison.
fn naive(idx: &PrefixIndex, hashes: &[u64], now: Instant) -> HashMap<RankKey, TierDepths> {
    let now = idx.units(now);
    let present = |h: u64, rank: RankKey, tier: usize| {
        holders(idx, h)
            .iter()
            .any(|(r, x)| *r == rank && x.tier() <= tier && x.live(now))
    };
    let ranks: std::collections::BTreeSet<RankKey> = idx
        .blocks
        .keys()
        .flat_map(|h| holders(idx, h.get()).into_iter().map(|(r, _)| r))
        .collect();
    depths_by_definition(ranks, hashes, present)
}

/// Each rank's depth per tier: how many of `chain`'s blocks, from the first, `present`
/// says it holds at that tier or a faster one (ranks matching nothing left out).
fn depths_by_definition(
    ranks: impl IntoIterator<Item = RankKey>,
    chain: &[u64],
    present: impl Fn(u64, RankKey, usize) -> bool,
) -> HashMap<RankKey, TierDepths> {
    let mut out = HashMap::new();
    for rank in ranks {
        let depth = |tier| {
            chain
                .iter()
                .take_while(|h| present(**h, rank, tier))
                .count() as u32
        };
        let d = TierDepths {
            gpu: depth(0),
            host: depth(1),
            disk: depth(2),
        };
        if d.disk > 0 {
            out.insert(rank, d);
        }
    }
    out
}

#[test]
fn matches_the_naive_definition_on_random_indexes() {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    let now = Instant::now();
    for _ in 0..600 {
        let mut idx = PrefixIndex::new(10_000, Instant::now());
        let chain: Vec<u64> = (0..24).map(|_| rng.random_range(0..40)).collect();
        // Half the indexes mostly GPU-tier, so blocks held only in the GPU tier by live
        // holders (`narrow_to_gpu_holders`) are common, not only the mixed-tier walk.
        let gpu_heavy = rng.random_bool(0.5);
        for _ in 0..rng.random_range(1..30) {
            let rank = RankKey {
                worker_id: rng.random_range(0..6),
                dp_rank: rng.random_range(0..2),
            };
            let start = rng.random_range(0..chain.len());
            let end = rng.random_range(start..=chain.len());
            let tier = if gpu_heavy && rng.random_bool(0.85) {
                Tier::Gpu
            } else {
                [Tier::Gpu, Tier::Host, Tier::Disk][rng.random_range(0..3)]
            };
            let expires = match rng.random_range(0..if gpu_heavy { 5 } else { 3 }) {
                0 => None,
                1 => Some(now - Duration::from_secs(1)),
                _ => Some(now + Duration::from_secs(1)),
            };
            idx.insert(rank, &chain[start..end], tier, expires);
        }
        if rng.random_bool(0.2) {
            idx.clear_rank(RankKey {
                worker_id: 1,
                dp_rank: 0,
            });
        }
        let got = idx.find_matches(&chain, now);
        assert!(got.windows(2).all(|w| w[0].0 < w[1].0), "sorted by rank");
        assert_eq!(
            got.into_iter().collect::<HashMap<_, _>>(),
            naive(&idx, &chain, now)
        );
    }
}

#[test]
fn expiring_entries_and_purge() {
    let mut idx = PrefixIndex::new(1000, Instant::now());
    let now = Instant::now();
    idx.insert(
        rank(1),
        &[1, 2],
        Tier::Gpu,
        Some(now + Duration::from_secs(2)),
    );
    assert_eq!(matches(&idx, &[1, 2], now)[&rank(1)].gpu, 2);
    assert!(idx
        .find_matches(&[1, 2], now + Duration::from_secs(2))
        .is_empty());
    // A permanent insert makes the entry permanent.
    idx.insert(rank(1), &[1], Tier::Gpu, None);
    idx.purge_expired(now + Duration::from_secs(3));
    assert_eq!(idx.len(), 1);
    assert_eq!(
        matches(&idx, &[1, 2], now + Duration::from_secs(9))[&rank(1)].gpu,
        1
    );
}

#[test]
fn dropping_an_expiring_entry_keeps_permanent_ones_and_other_holders() {
    let now = Instant::now();
    let later = Some(now + Duration::from_secs(60));
    let mut idx = PrefixIndex::new(1000, now);
    idx.insert(rank(1), &[1, 2, 3], Tier::Gpu, later);
    idx.insert(rank(2), &[1, 2, 3], Tier::Gpu, later);
    idx.insert(rank(3), &[1], Tier::Gpu, None);
    assert!(idx.drop_expiring(rank(1), 2, Tier::Gpu));
    assert!(!idx.drop_expiring(rank(1), 2, Tier::Gpu), "once");
    // Rank 1's chain now stops at block 1; rank 2's is whole.
    let m = matches(&idx, &[1, 2, 3], now);
    assert_eq!(m[&rank(1)].gpu, 1);
    assert_eq!(m[&rank(2)].gpu, 3);
    // An entry the engine's events made permanent stays.
    assert!(!idx.drop_expiring(rank(3), 1, Tier::Gpu));
    assert_eq!(matches(&idx, &[1], now)[&rank(3)].gpu, 1);
    assert!(!idx.drop_expiring(rank(9), 1, Tier::Gpu), "unknown rank");
}

#[test]
fn bounded_with_lru_eviction_and_clear_rank() {
    let mut idx = PrefixIndex::new(3, Instant::now());
    idx.insert(rank(1), &[1, 2, 3], Tier::Gpu, None); // a chain ages from its tail
    idx.insert(rank(2), &[3], Tier::Gpu, None); // touches 3: 2 is now coldest
    idx.insert(rank(2), &[4], Tier::Gpu, None);
    assert_eq!(idx.len(), 3);
    let now = Instant::now();
    assert_eq!(
        matches(&idx, &[1, 2, 3], now)[&rank(1)].gpu,
        1,
        "block 2 evicted"
    );
    idx.clear_rank(rank(2));
    assert!(
        !matches(&idx, &[3], now).contains_key(&rank(2)),
        "cleared at once"
    );
    idx.purge_expired(now);
    assert_eq!(idx.len(), 2, "its blocks go with the purge");
    idx.remove(rank(1), 1, Tier::Gpu);
    assert!(matches(&idx, &[1], now).is_empty());
}

#[test]
fn clearing_ranks_at_once_is_clearing_them_one_by_one() {
    let fill = || {
        let mut idx = PrefixIndex::new(1_000, Instant::now());
        idx.insert(rank(1), &[1, 2, 3], Tier::Gpu, None);
        idx.insert(rank(2), &[1, 2], Tier::Host, None);
        idx.insert(rank(3), &[1, 4], Tier::Gpu, None);
        idx.insert(rank(4), &[5], Tier::Gpu, None);
        idx
    };
    let now = Instant::now();
    let mut one_by_one = fill();
    one_by_one.clear_rank(rank(1));
    one_by_one.clear_rank(rank(4));
    let mut at_once = fill();
    at_once.clear_ranks(&[rank(1), rank(4), rank(9)]);
    for idx in [&mut one_by_one, &mut at_once] {
        assert_eq!(idx.len(), 5, "the blocks stay until the purge");
        let got = matches(idx, &[1, 2, 3], now);
        assert!(!got.contains_key(&rank(1)), "but match nothing at once");
        assert!(matches(idx, &[5], now).is_empty());
        idx.purge_expired(now);
        assert_eq!(idx.len(), 3, "blocks 1, 2, 4 stay: others hold them");
        let got = matches(idx, &[1, 2, 3], now);
        assert!(!got.contains_key(&rank(1)));
        assert_eq!(got[&rank(2)].host, 2);
        assert_eq!(got[&rank(3)].gpu, 1);
        assert!(matches(idx, &[5], now).is_empty());
    }
    // The freed ids are reused, and a re-added rank starts empty.
    at_once.insert(rank(1), &[7], Tier::Gpu, None);
    assert_eq!(matches(&at_once, &[1], now).get(&rank(1)), None);
    assert_eq!(matches(&at_once, &[7], now)[&rank(1)].gpu, 1);
    at_once.clear_ranks(&[]);
    assert_eq!(at_once.len(), 4);
}

#[test]
fn a_cleared_rank_matches_nothing_before_the_purge_and_its_id_carries_nothing_after() {
    let now = Instant::now();
    let mut idx = PrefixIndex::new(1_000, now);
    idx.insert(rank(1), &[1, 2], Tier::Gpu, None);
    idx.insert(rank(3), &[1, 2], Tier::Gpu, None);
    idx.insert(rank(2), &[9], Tier::Gpu, None);
    idx.clear_rank(rank(3));
    // Block 1 lists two holders, as many as there are live ranks, but one is the cleared
    // rank's: it is not the shared prefix of ranks 1 and 2.
    let over = idx.find_matches_over(&[1, 2], now);
    assert_eq!(over.base, 0);
    assert_eq!(over.depths_of(&rank(2)).disk, 0);
    assert_eq!(over.depths_of(&rank(1)).gpu, 2);
    assert_eq!(idx.retiring_ranks(), 1);
    // Where every live rank holds the block beside the cleared one, it is still shared.
    idx.insert(rank(2), &[1, 2], Tier::Gpu, None);
    assert_eq!(idx.find_matches_over(&[1, 2], now).base, 2);
    idx.remove(rank(2), 1, Tier::Gpu);
    idx.remove(rank(2), 2, Tier::Gpu);
    // A rank interned before the purge does not inherit the cleared id's holders.
    idx.insert(rank(4), &[7], Tier::Gpu, None);
    assert!(!matches(&idx, &[1, 2], now).contains_key(&rank(4)));
    idx.purge_expired(now);
    assert_eq!(idx.retiring_ranks(), 0);
    // Nor does one that takes the freed id after it.
    idx.insert(rank(5), &[8], Tier::Gpu, None);
    assert_eq!(idx.rank_ids[&rank(5)], 1, "the cleared rank's id, reused");
    let got = matches(&idx, &[1, 2], now);
    assert_eq!(got.keys().collect::<Vec<_>>(), vec![&rank(1)]);
    // Once only live holders are left, the shared prefix is recognised again.
    idx.clear_ranks(&[rank(2), rank(4), rank(5)]);
    idx.purge_expired(now);
    assert_eq!(idx.find_matches_over(&[1, 2], now).base, 2);
}

#[test]
fn a_cleared_ranks_blocks_make_room_before_live_blocks_are_evicted() {
    let now = Instant::now();
    for capacity in [100, SHARDED_EVICTION_FROM] {
        let mut idx = PrefixIndex::new(capacity, now);
        let half = capacity as u64 / 2;
        let older: Vec<u64> = (0..half).collect();
        idx.insert(rank(1), &older, Tier::Gpu, None);
        let restarted: Vec<u64> = (half..2 * half).collect();
        idx.insert(rank(2), &restarted, Tier::Gpu, None);
        idx.clear_rank(rank(2));
        // The restarted engine stores as many new blocks: room comes from its old ones.
        let fresh: Vec<u64> = (2 * half..3 * half).collect();
        idx.insert(rank(2), &fresh, Tier::Gpu, None);
        assert!(idx.len() <= capacity);
        assert_eq!(
            matches(&idx, &older, now)[&rank(1)].gpu as u64,
            half,
            "no live block of rank 1 evicted (capacity {capacity})"
        );
        assert_eq!(matches(&idx, &fresh, now)[&rank(2)].gpu as u64, half);
    }
}

#[test]
fn the_shared_prefix_check_looks_past_at_most_64_retiring_ids() {
    let now = Instant::now();
    for (cleared, base) in [(MAX_RETIRED_CHECKED, 1), (MAX_RETIRED_CHECKED + 1, 0)] {
        let mut idx = PrefixIndex::new(1_000, now);
        for w in 0..=cleared as u64 {
            idx.insert(rank(w), &[1], Tier::Gpu, None);
        }
        let gone: Vec<RankKey> = (1..=cleared as u64).map(rank).collect();
        idx.clear_ranks(&gone);
        let over = idx.find_matches_over(&[1], now);
        assert_eq!(over.base, base, "{cleared} retiring");
        // Either way the one live rank matches the block.
        assert_eq!(over.depths_of(&rank(0)).gpu, 1);
        idx.purge_expired(now);
        assert_eq!(idx.find_matches_over(&[1], now).base, 1, "after the sweep");
    }
}

/// A (block, rank, tier)'s state in [`PlainModel`]: counted references, or held until.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Held {
    Refs(u32),
    Until(Instant),
}

const TIERS: [Tier; 3] = [Tier::Gpu, Tier::Host, Tier::Disk];

/// The index's contract as a plain map of (block, rank, tier) -> state.
#[derive(Default)]
struct PlainModel(HashMap<(u64, RankKey, Tier), Held>);

impl PlainModel {
    fn insert(&mut self, rank: RankKey, hashes: &[u64], tier: Tier, expires: Option<Instant>) {
        use std::collections::hash_map::Entry;
        for h in hashes {
            match self.0.entry((*h, rank, tier)) {
                Entry::Vacant(v) => {
                    v.insert(expires.map_or(Held::Refs(1), Held::Until));
                }
                Entry::Occupied(mut o) => {
                    let next = match (*o.get(), expires) {
                        (Held::Refs(n), None) => Held::Refs(n + 1),
                        (Held::Refs(n), Some(_)) => Held::Refs(n),
                        (Held::Until(_), None) => Held::Refs(1),
                        (Held::Until(a), Some(b)) => Held::Until(a.max(b)),
                    };
                    o.insert(next);
                }
            }
        }
    }

    /// Drops one reference; whether the rank still holds the block in some tier.
    fn release(&mut self, rank: RankKey, h: u64, tier: Tier) -> bool {
        match self.0.get(&(h, rank, tier)).copied() {
            Some(Held::Refs(n)) if n > 1 => {
                self.0.insert((h, rank, tier), Held::Refs(n - 1));
            }
            Some(_) => {
                self.0.remove(&(h, rank, tier));
            }
            None => {}
        }
        TIERS
            .iter()
            .any(|t| matches!(self.0.get(&(h, rank, *t)), Some(Held::Refs(_))))
    }

    fn live(&self, h: u64, rank: RankKey, tier: usize, now: Instant) -> bool {
        TIERS[..=tier]
            .iter()
            .any(|t| match self.0.get(&(h, rank, *t)) {
                Some(Held::Refs(_)) => true,
                Some(Held::Until(e)) => *e > now,
                None => false,
            })
    }

    /// Every rank's matched depths of `chain` (ranks matching nothing left out).
    fn expected(&self, chain: &[u64], now: Instant) -> HashMap<RankKey, TierDepths> {
        let ranks: std::collections::BTreeSet<RankKey> =
            self.0.keys().map(|(_, r, _)| *r).collect();
        depths_by_definition(ranks, chain, |h, r, t| self.live(h, r, t, now))
    }
}

/// One random operation on both the index and the model; `now` may move.
fn random_step(
    rng: &mut rand::rngs::StdRng,
    idx: &mut PrefixIndex,
    model: &mut PlainModel,
    chain: &[u64],
    now: &mut Instant,
) {
    use rand::Rng;
    let rank = RankKey {
        worker_id: rng.random_range(0..4),
        dp_rank: rng.random_range(0..2),
    };
    let tier = TIERS[rng.random_range(0..3)];
    let start = rng.random_range(0..chain.len());
    let end = rng.random_range(start..=chain.len());
    let h = chain[start.min(chain.len() - 1)];
    match rng.random_range(0..10) {
        0..=3 => {
            let expires = (rng.random_bool(0.5))
                .then(|| *now + Duration::from_millis(rng.random_range(1..3000)));
            idx.insert(rank, &chain[start..end], tier, expires);
            model.insert(rank, &chain[start..end], tier, expires);
        }
        4..=5 => {
            let still = idx.release(rank, h, tier);
            let expected = model.release(rank, h, tier);
            assert_eq!(still, expected, "release reports what is still held");
        }
        6 => {
            idx.remove(rank, h, tier);
            model.0.remove(&(h, rank, tier));
        }
        7 => {
            idx.clear_rank(rank);
            model.0.retain(|(_, r, _), _| *r != rank);
        }
        8 => {
            *now += Duration::from_millis(rng.random_range(0..1500));
            idx.purge_expired(*now);
            let now = *now;
            model.0.retain(|_, m| match m {
                Held::Refs(_) => true,
                Held::Until(e) => *e > now,
            });
        }
        _ => *now += Duration::from_millis(rng.random_range(0..1500)),
    }
}

/// Every lookup of the index agrees with the model.
fn agrees(idx: &PrefixIndex, model: &PlainModel, chain: &[u64], now: Instant) {
    let expected = model.expected(chain, now);
    assert_eq!(matches(idx, chain, now), expected);
    // One rank's depths, and the shared prefix once plus the deeper ranks, say the same
    // for every interned rank.
    let over = idx.find_matches_over(chain, now);
    for r in idx.rank_ids.keys() {
        let d = expected.get(r).copied().unwrap_or_default();
        assert_eq!(idx.rank_depths(r, chain, now), d, "{r:?}");
        let listed = over.ranks.iter().find(|(k, _)| k == r).map(|(_, d)| *d);
        let shared = TierDepths {
            gpu: over.base,
            host: over.base,
            disk: over.base,
        };
        assert_eq!(listed.unwrap_or(shared), d, "{r:?} base {}", over.base);
    }
    let blocks: std::collections::HashSet<u64> = model.0.keys().map(|(h, _, _)| *h).collect();
    assert!(idx.len() >= blocks.len());
}

/// Random operation sequences against a plain map of (block, rank, tier) -> state.
#[test]
fn operations_match_a_plain_model() {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let base = Instant::now();
    for round in 0..200 {
        let mut idx = PrefixIndex::new(100_000, Instant::now());
        let mut model = PlainModel::default();
        let chain: Vec<u64> = (0..12).map(|i| 1000 * round + i).collect();
        let mut now = base;
        for _ in 0..rng.random_range(1..80) {
            random_step(&mut rng, &mut idx, &mut model, &chain, &mut now);
            agrees(&idx, &model, &chain, now);
        }
    }
}

#[test]
fn expiries_survive_moving_the_epoch() {
    let mut idx = PrefixIndex::new(100, Instant::now());
    // Far enough ahead that time units near the end of their range.
    let now = Instant::now() + Duration::from_secs(20 * 86_400);
    idx.insert(rank(1), &[1], Tier::Gpu, Some(now + Duration::from_secs(2)));
    idx.insert(rank(2), &[1, 2], Tier::Gpu, None);
    idx.insert(rank(3), &[2], Tier::Gpu, Some(now + Duration::from_secs(5)));
    let before = idx.epoch;
    idx.purge_expired(now);
    assert!(idx.epoch > before, "epoch moved");
    let at = |secs| matches(&idx, &[1, 2], now + Duration::from_secs(secs));
    assert_eq!(at(1)[&rank(1)].gpu, 1);
    assert_eq!(at(1)[&rank(2)].gpu, 2);
    assert!(!at(3).contains_key(&rank(1)), "expired at +2 s");
    assert_eq!(
        matches(&idx, &[2], now + Duration::from_secs(4))[&rank(3)].gpu,
        1
    );
    assert!(!matches(&idx, &[2], now + Duration::from_secs(6)).contains_key(&rank(3)));
}

#[test]
fn lru_clock_wraps_without_losing_order() {
    let mut idx = PrefixIndex::new(2, Instant::now());
    idx.tick = u32::MAX - 3;
    idx.insert(rank(1), &[1], Tier::Gpu, None);
    idx.insert(rank(1), &[2], Tier::Gpu, None); // wraps: ticks halve
    idx.insert(rank(1), &[3], Tier::Gpu, None);
    assert_eq!(idx.len(), 2);
    let now = Instant::now();
    assert!(matches(&idx, &[1], now).is_empty(), "oldest evicted");
    assert_eq!(matches(&idx, &[3], now)[&rank(1)].gpu, 1);
}

#[test]
fn a_single_holder_block_is_one_small_entry() {
    assert_eq!(std::mem::size_of::<(BlockKey, Entry)>(), 20);
    assert_eq!(std::mem::size_of::<Holder>(), 8);
    let mut idx = PrefixIndex::new(100, Instant::now());
    idx.insert(rank(1), &[1, 2], Tier::Gpu, None);
    assert!(idx.slab.is_empty(), "no holder list for one holder");
    idx.insert(rank(2), &[1], Tier::Gpu, None);
    assert_eq!(idx.slab.len(), 1);
    idx.clear_rank(rank(2));
    assert!(!idx.rank_ids.contains_key(&rank(2)), "rank id retired");
    idx.purge_expired(Instant::now());
    assert_eq!(idx.free_slab.len(), 1, "list freed when one holder is left");
    assert_eq!(idx.free_ranks, vec![1], "id free after a purge round");
}

/// Exact eviction with many blocks tied at the cutoff (as halved LRU ticks leave them): the
/// older blocks all go, whatever order the table visits them in, and ties make up the rest.
#[test]
fn older_blocks_go_before_ties_at_the_cutoff() {
    let cap = 64;
    let mut idx = PrefixIndex::new(cap, Instant::now());
    // Shards are visited in order and bits 40.. pick one: the older blocks sit in the last
    // shard, so the pass meets every tied block first.
    let key = |shard: u64, n: u64| (shard << 40) | n;
    let old: Vec<u64> = (0..3).map(|n| key(15, n)).collect();
    let tied: Vec<u64> = (100..100 + cap as u64 - 3)
        .map(|n| key(n % 15, n))
        .collect();
    idx.insert(
        rank(1),
        &[old.clone(), tied.clone()].concat(),
        Tier::Gpu,
        None,
    );
    assert_eq!(idx.len(), cap);
    for (k, touched) in old.iter().zip(1..).chain(tied.iter().map(|k| (k, 10))) {
        idx.blocks.get_mut(&BlockKey::new(*k)).unwrap().touched = touched;
    }
    idx.insert(rank(1), &[key(0, 1_000)], Tier::Gpu, None);
    // Down to 60: the 3 older blocks and 2 of the 61 tied ones.
    assert_eq!(idx.len(), cap - cap / 16);
    for k in &old {
        assert!(
            !idx.blocks.contains_key(&BlockKey::new(*k)),
            "an older block survived"
        );
    }
    let tied_left = tied
        .iter()
        .filter(|k| idx.blocks.contains_key(&BlockKey::new(**k)))
        .count();
    assert_eq!(tied_left, tied.len() - 2);
}

#[test]
fn big_indexes_evict_by_sampled_cutoff_and_keep_the_recent() {
    let cap = 100_000;
    let mut idx = PrefixIndex::new(cap, Instant::now());
    for h in 0..300_000u64 {
        idx.insert(rank(1), &[h], Tier::Gpu, None);
        assert!(idx.len() <= cap);
    }
    assert!(
        idx.len() >= cap - cap / 16 - cap / 64,
        "evicted about one batch at a time ({} of {cap})",
        idx.len()
    );
    // Everything touched since the last eviction, and the newest 80k, are kept.
    let kept = (220_000..300_000u64)
        .filter(|h| idx.blocks.contains_key(&BlockKey::new(*h)))
        .count();
    assert_eq!(kept, 80_000);
    let oldest = (0..100_000u64)
        .filter(|h| idx.blocks.contains_key(&BlockKey::new(*h)))
        .count();
    assert_eq!(oldest, 0);
}

/// Keys that do not spread (small integers) all land in one shard: a step then removes a
/// sixteenth of the capacity, not a quarter of that shard (a quarter of the index).
#[test]
fn one_step_never_removes_more_than_a_sixteenth_of_the_capacity() {
    let cap = 4 * SHARDED_EVICTION_FROM;
    let mut idx = PrefixIndex::new(cap, Instant::now());
    let keys: Vec<u64> = (0..cap as u64 + 1).collect();
    idx.insert(rank(1), &keys[..cap], Tier::Gpu, None);
    assert_eq!(idx.len(), cap);
    assert_eq!(
        idx.blocks.maps.iter().filter(|m| !m.is_empty()).count(),
        1,
        "small keys share one shard"
    );
    idx.insert(rank(1), &keys[cap..], Tier::Gpu, None);
    let removed = cap + 1 - idx.len();
    assert!(
        (cap / 16 * 3 / 4..cap / 16 * 5 / 4).contains(&removed),
        "a sixteenth of the capacity ({removed} of {cap})"
    );
}

/// A big index at capacity evicts a shard's oldest quarter per step, not a part of the whole
/// table: an insert one block over capacity removes about `cap / 64` blocks, and
/// what goes is old (the newest half of everything inserted is always kept).
#[test]
fn big_indexes_evict_one_shard_at_a_time_and_keep_the_recent() {
    let cap = 4 * SHARDED_EVICTION_FROM;
    let mut idx = PrefixIndex::new(cap, Instant::now());
    let keys: Vec<u64> = (0..3 * cap as u64).map(crate::hash::text_id_u64).collect();
    idx.insert(rank(1), &keys[..cap], Tier::Gpu, None);
    assert_eq!(idx.len(), cap, "at capacity, nothing evicted");
    idx.insert(rank(1), &keys[cap..=cap], Tier::Gpu, None);
    let removed = cap + 1 - idx.len();
    assert!(
        (cap / 64 * 3 / 4..cap / 64 * 5 / 4).contains(&removed),
        "one shard's quarter ({removed} of {cap})"
    );
    for chunk in keys[cap + 1..].chunks(1_000) {
        idx.insert(rank(1), chunk, Tier::Gpu, None);
        assert!(idx.len() <= cap);
    }
    assert!(idx.len() >= cap - cap / 64, "evicts in small steps");
    let recent = &keys[keys.len() - cap / 2..];
    let kept = recent
        .iter()
        .filter(|h| idx.blocks.contains_key(&BlockKey::new(**h)))
        .count();
    assert_eq!(kept, recent.len(), "the newest half is kept");
    let oldest = &keys[..cap];
    let survivors = oldest
        .iter()
        .filter(|h| idx.blocks.contains_key(&BlockKey::new(**h)))
        .count();
    assert_eq!(survivors, 0, "the first capacity's worth is gone");
}

/// While a big index fills, its shards grow one insert at a time (never all 16 in the same
/// insert, which would rehash the whole table at once), and no shard grows past what a full
/// index needs.
#[test]
fn shards_grow_one_insert_at_a_time_while_the_index_fills() {
    // 16 shards, and (two of them per purge step) 32.
    for cap in [1 << 20, 1 << 21] {
        grows_one_insert_at_a_time(cap);
    }
}

fn grows_one_insert_at_a_time(cap: usize) {
    let mut idx = PrefixIndex::new(cap, Instant::now());
    let capacities = |idx: &PrefixIndex| -> Vec<usize> {
        idx.blocks.maps.iter().map(|m| m.capacity()).collect()
    };
    let mut before = capacities(&idx);
    let mut most_grown_at_once = 0;
    for r in 0..((600 * cap as u64) >> 20) {
        let keys: Vec<u64> = (0..2_300u64)
            .map(|b| crate::hash::text_id_u64((r << 32) | b))
            .collect();
        idx.insert(rank(1), &keys, Tier::Gpu, None);
        let after = capacities(&idx);
        // A growth doubles a shard; deletions only move `capacity()` a little.
        let grown = before
            .iter()
            .zip(&after)
            .filter(|(b, a)| **a > **b * 3 / 2)
            .count();
        // Small tables (a few hundred blocks a shard) still grow naturally, together.
        if before.iter().all(|&c| c >= 8_192) {
            most_grown_at_once = most_grown_at_once.max(grown);
        }
        before = after;
    }
    assert!(idx.len() > cap - cap / 64, "filled to capacity");
    assert_eq!(most_grown_at_once, 1, "one shard per insert");
    let share = cap / idx.blocks.maps.len();
    assert!(share <= shards::MAX_SHARE);
    assert!(
        before.iter().all(|&c| c >= share && c < 4 * share),
        "each shard holds its share, not more than the next step: {before:?}"
    );
}

/// The shard count grows with the capacity, so no shard's table (rehashed whole when it
/// grows, under the KV write lock) holds more than `MAX_SHARE` blocks of a full index:
/// 16 shards up to 16 × `MAX_SHARE`, 32 from one block more.
#[test]
fn no_shard_holds_more_than_its_share_of_a_full_index() {
    let at_limit = PURGE_SHARDS * shards::MAX_SHARE;
    for (cap, shards) in [
        (1, 16),
        (100, 16),
        (1 << 20, 16),
        (at_limit, 16),
        (at_limit + 1, 32),
        (32 << 20, 512),
    ] {
        let idx = PrefixIndex::new(cap, Instant::now());
        assert_eq!(idx.blocks.maps.len(), shards, "capacity {cap}");
        assert!(cap.div_ceil(shards) <= shards::MAX_SHARE);
    }
}

/// A purge step walks a sixteenth of the shards: an index full of expired predictions is
/// emptied over [`PURGE_SHARDS`] steps, each removing about its share, never all at once,
/// with 16 shards and with 32 (two a step).
#[test]
fn purging_is_incremental_a_sixteenth_per_step() {
    for cap in [1 << 20, 1 << 21] {
        purges_a_sixteenth_per_step(cap);
    }
}

fn purges_a_sixteenth_per_step(cap: usize) {
    let t0 = Instant::now();
    let mut idx = PrefixIndex::new(cap, t0);
    let rank = RankKey {
        worker_id: 1,
        dp_rank: 0,
    };
    let hashes: Vec<u64> = (0..16_000u64).map(crate::hash::text_id_u64).collect();
    idx.insert(rank, &hashes, Tier::Gpu, Some(t0 + Duration::from_secs(1)));
    let later = t0 + Duration::from_secs(2);
    let mut sizes = vec![idx.len()];
    for _ in 0..PURGE_SHARDS {
        idx.purge_expired_step(later);
        sizes.push(idx.len());
    }
    assert_eq!(sizes[0], 16_000);
    assert_eq!(*sizes.last().unwrap(), 0, "a full round purges everything");
    for w in sizes.windows(2) {
        let removed = w[0] - w[1];
        assert!(
            (600..1_400).contains(&removed),
            "each step removes about 1/16 ({removed}): {sizes:?}"
        );
    }
}
