//! Scale-out (issue 28): what the shard roles agree on, pure.
//!
//! - [`Role`]: which part of the pipeline one core runs — everything (`All`, one
//!   process), an ingest shard (batches → records, which leave for the matchers), a
//!   matcher shard (records of its communicators → verdicts and health), or the API
//!   role (a mirror of what the others publish).
//! - [`matcher_shard`]: the matcher shard that owns a communicator — a hash range of the
//!   communicator's hash, so every rank of one communicator meets in one shard.
//! - [`route`]: where one record goes. Records about a communicator (lifecycle frames,
//!   PROGRESS entries) go to its shard; records about a node (P0 watermarks and loss
//!   intervals, liveness, knowledge and shipper gaps, epochs) go to every shard; bulk
//!   watermarks and loss intervals of other classes go nowhere (no matcher reads them:
//!   bulk stays on its ingest shard). An
//!   ingest shard publishes a node's records in the order ingest produced them, each to
//!   its subject, so a node's watermark reaches every matcher shard after the records it
//!   covers — the one ordering the matcher needs (a watermark never overtakes its own
//!   node's records; nodes of different ingest shards may interleave anyhow).
//! - The messages: [`RecordBatch`] (an ingest shard's records for one matcher shard,
//!   each with its index in the shard's record sequence), [`NodeSummary`] (one node's
//!   ingest state, for the API), [`ShardHealth`] (a matcher shard's node and GPU health).

use rkyv::{Archive, Deserialize, Serialize};

use crate::ingest::NodeState;
use crate::matcher::Health;
use crate::records::{NodeId, Record};

/// Which part of the pipeline a core runs.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Role {
    /// Ingest and matcher in one process (no NATS).
    #[default]
    All,
    /// An ingest shard: its records are held for publishing
    /// ([`crate::Core::unpublished`]) instead of reaching a matcher.
    Ingest { shard: u32 },
    /// A matcher shard: records come from its stream ([`crate::Core::apply_records`]).
    Matcher { shard: u32, shards: u32 },
    /// The API role: node state, health and events are installed from what the ingest
    /// and matcher shards publish.
    Api,
}

/// The most ingest shards (their index is in the top bits of their loss interval ids).
pub const MAX_INGEST_SHARDS: u32 = 1024;
/// The most matcher shards.
pub const MAX_MATCHER_SHARDS: u32 = 1024;

/// Where an ingest shard's loss interval ids start: ids are unique per core, and a
/// matcher shard hears from every ingest shard, so each numbers from its own base.
#[must_use]
pub fn loss_id_base(ingest_shard: u32) -> u64 {
    u64::from(ingest_shard.min(MAX_INGEST_SHARDS)) << 48
}

/// SplitMix64's finalizer: a fixed, portable mixing of 64 bits (the shard a
/// communicator lands on must not change between builds or machines).
#[must_use]
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The matcher shard owning communicator `comm_hash` among `shards` (0 or 1: shard 0):
/// shard `i` owns the `i`-th of `shards` equal ranges of the mixed hash.
#[must_use]
pub fn matcher_shard(comm_hash: u64, shards: u32) -> u32 {
    if shards <= 1 {
        return 0;
    }
    let h = u128::from(mix64(comm_hash));
    let s = (h.wrapping_mul(u128::from(shards))) >> 64;
    u32::try_from(s).unwrap_or(0)
}

/// Where a record goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// To the matcher shard owning its communicator.
    One(u32),
    /// To every matcher shard (it is about a node).
    All,
    /// Nowhere: no matcher uses it (bulk watermarks, loss intervals of bulk and P1
    /// streams — bulk never leaves its ingest shard; its accounting reaches the API in
    /// the node summaries).
    Nowhere,
}

/// Where a record goes: lifecycle frames and PROGRESS entries to their communicator's
/// shard; P0 watermarks, P0 loss intervals, liveness, knowledge gaps, shipper gaps and
/// epochs to every shard; the rest nowhere.
#[must_use]
pub fn route(record: &Record, shards: u32) -> Route {
    match record {
        Record::Lifecycle(l) => Route::One(matcher_shard(l.comm.hash, shards)),
        Record::Progress(p) => Route::One(matcher_shard(p.comm.hash, shards)),
        Record::Watermark(w) if w.class != 0 => Route::Nowhere,
        Record::Loss(l) if l.stream.stream_id >> 24 != 0 => Route::Nowhere,
        Record::Loss(_)
        | Record::Watermark(_)
        | Record::Liveness(_)
        | Record::KnowledgeGap(_)
        | Record::ShipperGap(_)
        | Record::Epoch(_) => Route::All,
    }
}

/// Whether matcher shard `shard` of `shards` takes `record`.
#[must_use]
pub fn takes(record: &Record, shard: u32, shards: u32) -> bool {
    match route(record, shards) {
        Route::One(s) => s == shard,
        Route::All => true,
        Route::Nowhere => false,
    }
}

/// An ingest shard's records for one matcher shard, in production order; each with its
/// index in the ingest shard's record sequence (indices rise within a batch, and from
/// one batch to the next of the same ingest shard and process) and the ingest shard's
/// aggregator time when it was produced.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct RecordBatch {
    pub ingest_shard: u32,
    /// The ingest shard's aggregator epoch (one per start).
    pub epoch: u64,
    /// How many matcher shards the ingest shard routed for (a matcher that counts
    /// otherwise is misconfigured: it says so).
    pub matcher_shards: u32,
    pub records: Vec<(u64, u64, Record)>,
}

/// Records an ingest shard holds unpublished, at most: past it the shell stops reading
/// batches until the bus has caught up (QUIC flow control holds the shippers back; their
/// spools keep what they cannot send), so nothing is refused or lost for it.
pub const MAX_UNPUBLISHED: usize = 1 << 20;

/// Events a matcher shard holds not yet on the bus, at most: past it the shell applies
/// no more records until they drain (the stream keeps them), so none is dropped.
pub const MAX_UNPUBLISHED_EVENTS: usize = 1 << 20;

/// One node's ingest state as an ingest shard has it, with the node's name and
/// connections (the API role's registry).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct NodeSummary {
    pub ingest_shard: u32,
    pub node: NodeId,
    pub name: String,
    pub live: u32,
    pub connections: u64,
    pub state: NodeState,
    /// What `state`'s archive leaves out: the shipper's last reported state and the
    /// rank owners of its last heartbeat.
    pub shipper: Option<crate::ingest::ShipperState>,
    pub owners: Vec<crate::ingest::GpuOwner>,
}

/// A matcher shard's health of every node and GPU it knows, at its time `at_ns`.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
pub struct ShardHealth {
    pub shard: u32,
    pub at_ns: u64,
    pub nodes: Vec<(NodeId, Health)>,
    pub gpus: Vec<(NodeId, [u8; 16], Health)>,
}

/// A matcher shard's events, in order: `first` is the index of the first in the shard's
/// event sequence since its start (`epoch`).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct VerdictBatch {
    pub shard: u32,
    pub epoch: u64,
    pub first: u64,
    pub events: Vec<crate::verdict::MatcherEvent>,
}

/// Errors decoding a message from the bus.
#[derive(Debug, thiserror::Error)]
#[error("undecodable {what}: {why}")]
pub struct DecodeError {
    pub what: &'static str,
    pub why: String,
}

/// Serializes a message (rkyv).
///
/// # Errors
/// rkyv could not serialize it (never for these types in practice).
pub fn encode<T>(value: &T) -> Result<Vec<u8>, DecodeError>
where
    T: for<'a> Serialize<
        rkyv::api::high::HighSerializer<
            rkyv::util::AlignedVec,
            rkyv::ser::allocator::ArenaHandle<'a>,
            rkyv::rancor::Error,
        >,
    >,
{
    rkyv::to_bytes::<rkyv::rancor::Error>(value)
        .map(|v| v.to_vec())
        .map_err(|e| DecodeError { what: std::any::type_name::<T>(), why: e.to_string() })
}

/// Deserializes a message from outside bytes: validated (bytecheck) first, never a
/// panic; a bad one is an error naming what it was.
///
/// # Errors
/// The bytes are not a valid archive of `T`.
pub fn decode<T>(bytes: &[u8], what: &'static str) -> Result<T, DecodeError>
where
    T: Archive,
    T::Archived: for<'a> rkyv::bytecheck::CheckBytes<rkyv::api::high::HighValidator<'a, rkyv::rancor::Error>>
        + Deserialize<T, rkyv::api::high::HighDeserializer<rkyv::rancor::Error>>,
{
    let mut aligned = rkyv::util::AlignedVec::<16>::with_capacity(bytes.len());
    aligned.extend_from_slice(bytes);
    rkyv::from_bytes::<T, rkyv::rancor::Error>(&aligned).map_err(|e| DecodeError { what, why: e.to_string() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn communicators_spread_over_every_shard_and_stay_put() {
        let mut hits = [0u32; 4];
        for c in 0..4000u64 {
            let s = matcher_shard(c.wrapping_mul(0x9e37_79b9_7f4a_7c15), 4);
            assert!(s < 4);
            assert_eq!(s, matcher_shard(c.wrapping_mul(0x9e37_79b9_7f4a_7c15), 4), "stable");
            hits[s as usize] += 1;
        }
        assert!(hits.iter().all(|&h| h > 800), "roughly even: {hits:?}");
        assert_eq!(matcher_shard(12345, 1), 0);
        assert_eq!(matcher_shard(12345, 0), 0);
    }

    #[test]
    fn garbage_decodes_to_an_error_not_a_panic() {
        for bytes in [&b""[..], &b"\x01\x02\x03"[..], &[0xffu8; 64][..]] {
            assert!(decode::<RecordBatch>(bytes, "record batch").is_err());
            assert!(decode::<ShardHealth>(bytes, "shard health").is_err());
        }
        let h = ShardHealth { shard: 1, at_ns: 9, nodes: vec![(NodeId(3), Health::Degraded)], gpus: vec![] };
        assert_eq!(decode::<ShardHealth>(&encode(&h).unwrap(), "shard health").unwrap(), h);
    }
}
