//! The kernel maps the shipper shares with the eBPF programs (`node-shipper/bpf/`):
//! not on the wire, but the same contract with C (`include/ringwatch.h`), so the same
//! parity test holds them.
//!
//! - `rw_counters`: PERCPU_ARRAY keyed by ring index ([`RING_P0`], [`RING_BULK`]), one
//!   [`RingCounters`] per (ring, CPU) — exactly one stream's kernel counters.
//! - `rw_control`: ARRAY of one [`SamplingControl`], written by the shipper.
//! - `rw_if_counters`: PERCPU_HASH keyed by ifindex (`u32`), one [`IfCounters`] per
//!   (interface, CPU), at most [`MAX_INTERFACES`] interfaces; `rw_if_overflow`: a
//!   PERCPU_ARRAY of one [`IfCounters`] for the packets of interfaces beyond the cap.
//! - `rw_meta`: ARRAY of one [`EpochMeta`], written by the shipper that created the maps;
//!   pinned with them, so a restarted shipper keeps the epoch.

use zerocopy::little_endian::{U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::codes::DROP_SLOTS;

/// Ring index of the P0 (collective lifecycle) ring.
pub const RING_P0: u8 = 0;
/// Ring index of the bulk ring.
pub const RING_BULK: u8 = 1;
/// Rings per node.
pub const RING_COUNT: u8 = 2;
/// Highest bulk sampling level: keep 1 in 2^15 events.
pub const MAX_SAMPLING_LEVEL: u8 = 15;
/// The layout of the maps pinned under the shipper's pin directory (their value
/// structs, sizes and meaning), stored in the pinned `rw_layout` map. A shipper that
/// finds pins of another layout removes them and starts a new epoch instead of reading
/// them. Raise it whenever a pinned map's layout changes. (Pins from before `rw_layout`
/// existed have layout 1.)
/// (2: the per-interface counter maps.)
pub const PIN_LAYOUT: u32 = 2;
/// Interfaces the kernel's per-interface counter map holds; the packets of any further
/// one count in `rw_if_overflow`.
pub const MAX_INTERFACES: u32 = 64;

/// One (ring, CPU)'s counters (96 B). The program decides sampling first (a sampled-out
/// event bumps `sampled_out` and takes no seq), then takes `seq`, then reserves ring
/// space; a failed reserve bumps `drops[cause − 1]`.
#[repr(C)]
#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned, Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingCounters {
    /// The next seq: the stream's `attempted_seq` (exclusive).
    pub seq: U64,
    pub drops: [U64; DROP_SLOTS],
    pub sampled_out: U64,
    /// Events offered to the sampler (kept or not).
    pub sample_tick: U64,
    /// Bulk rings: 1 after a failed reserve, until the ring is at most half full again.
    /// While set, events take their seq and count as `kernel_ring_full` drops without
    /// trying the ring: an overflow then leaves one hole per episode instead of one per
    /// record the reader frees (a reader frees space record by record, and a producer
    /// faster than it would otherwise fill every freed slot: thousands of one-seq holes).
    pub shedding: U64,
}
const _: () = assert!(size_of::<RingCounters>() == 96);

/// One (interface, CPU)'s packets and bytes as the bulk XDP program saw them: every
/// packet, counted before sampling and before the ring (16 B).
#[repr(C)]
#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned, Clone, Copy, Debug, PartialEq, Eq)]
pub struct IfCounters {
    pub packets: U64,
    pub bytes: U64,
}
const _: () = assert!(size_of::<IfCounters>() == 16);

/// The shipper's sampling decision (8 B).
#[repr(C)]
#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned, Clone, Copy, Debug, PartialEq, Eq)]
pub struct SamplingControl {
    /// Bulk keeps 1 in 2^level events (0: all), each kept frame with weight 2^level.
    /// Collective frames are never sampled.
    pub bulk_level: U32,
    pub _reserved0: U32,
}
const _: () = assert!(size_of::<SamplingControl>() == 8);

/// Who created the counters, and when (48 B).
#[repr(C)]
#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned, Clone, Copy, Debug, PartialEq, Eq)]
pub struct EpochMeta {
    pub epoch: U64,
    pub start_realtime_ns: U64,
    pub start_mono_ns: U64,
    /// Shipper sessions that took the rings over, the current one included.
    pub sessions: U64,
    pub boot_id: [u8; 16],
}
const _: () = assert!(size_of::<EpochMeta>() == 48);

/// The PROGRESS map's key (32 B): `(comm key, comm instance, rank)`.
#[repr(C)]
#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned, Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProgressKey {
    pub comm_hash: U64,
    pub comm_disambiguator: U64,
    pub comm_instance: U64,
    pub rank: U32,
    pub _reserved0: U32,
}
const _: () = assert!(size_of::<ProgressKey>() == 32);

/// PROGRESS bookkeeping (16 B): entries created (created − present = LRU evictions) and
/// process exits recorded.
#[repr(C)]
#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned, Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProgressStats {
    pub inserted: U64,
    pub exits: U64,
}
const _: () = assert!(size_of::<ProgressStats>() == 16);
