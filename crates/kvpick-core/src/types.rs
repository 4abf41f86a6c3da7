//! The shared vocabulary at the bottom of the core: the schedulable unit ([`RankKey`]), a worker's
//! [`Lifecycle`], KV-cache tiers and matched depths. Every other module (and the hosts) speaks
//! these; this module imports nothing from the crate.

/// `(worker_id, dp_rank)`: the schedulable unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RankKey {
    pub worker_id: u64,
    pub dp_rank: u32,
}

/// What a rank does under prefill/decode disaggregation (`llm-d.ai/role`): `Both` (the default,
/// aggregated serving) runs whole requests; `Prefill` only prefills for a decode rank that pulls
/// the KV; `Decode` decodes (and prefills locally when disaggregating does not pay).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Role {
    Prefill,
    Decode,
    #[default]
    Both,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Both => "both",
        }
    }

    /// `prefill`, `decode` or `both` (llm-d also labels decode pods `prefill-decode`: both).
    pub fn parse(value: &str) -> Option<Role> {
        match value.trim().to_ascii_lowercase().as_str() {
            "prefill" => Some(Role::Prefill),
            "decode" => Some(Role::Decode),
            "both" | "prefill-decode" | "" => Some(Role::Both),
            _ => None,
        }
    }

    /// Whether the rank may be a request's destination (decode side).
    pub fn decodes(self) -> bool {
        self != Role::Prefill
    }

    /// Whether the rank may prefill for another rank.
    pub fn prefills(self) -> bool {
        self != Role::Decode
    }
}

/// A worker's lifecycle as the scheduler sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Lifecycle {
    Incomplete,
    Schedulable,
    Draining,
    Unschedulable,
}

impl Lifecycle {
    pub fn as_str(self) -> &'static str {
        match self {
            Lifecycle::Incomplete => "Incomplete",
            Lifecycle::Schedulable => "Schedulable",
            Lifecycle::Draining => "Draining",
            Lifecycle::Unschedulable => "Unschedulable",
        }
    }

    pub const ALL: [Lifecycle; 4] = [
        Lifecycle::Incomplete,
        Lifecycle::Schedulable,
        Lifecycle::Draining,
        Lifecycle::Unschedulable,
    ];
}

/// Where a block lives on a rank. Lower tiers count less toward overlap.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tier {
    Gpu = 0,
    Host = 1,
    Disk = 2,
}

/// Matched depths (in blocks) for one rank: `gpu <= host <= disk`, each the longest consecutive
/// prefix present in that tier or a faster one.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierDepths {
    pub gpu: u32,
    pub host: u32,
    pub disk: u32,
}

/// A partition: the ranks of one `(model, routing_group)`, scheduled together.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PartitionKey {
    pub model: String,
    pub routing_group: String,
}

/// Load of one rank, derived only from bookings.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RankLoad {
    pub active_prefill_tokens: u64,
    pub active_decode_blocks: u64,
    pub active_requests: u64,
}
