//! Sectioned data: heartbeat and session_start frames, and the batch's stream summary.
//!
//! A sectioned frame is `header | head (head_len bytes) | section*`; a section is an
//! 8-byte [`SectionHeader`] `{tag, entry_len, count}` followed by `count` entries of
//! `entry_len` bytes. Readers skip unknown tags, read known entries by prefix (a later
//! version may append fields: `entry_len` grows) and reject an `entry_len` below v1's
//! size as `TooShort`.
//!
//! Invariant: [`Sectioned::parse`] checks every section's bounds up front, so iterating
//! afterwards cannot fail or panic.

use core::marker::PhantomData;

use zerocopy::little_endian::{I32, U16, U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::codes::{DROP_SLOTS, LossCause, ProcState, SectionTag, WireEnum};
use crate::error::DecodeError;
use crate::frames::CommKey;
use crate::header::{FrameHeader, StreamId};

/// Leads every section (8 B).
#[repr(C)]
#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned, Clone, Copy, Debug, PartialEq, Eq)]
pub struct SectionHeader {
    /// [`SectionTag`] code.
    pub tag: U16,
    /// Bytes per entry (≥ the v1 entry size for known tags).
    pub entry_len: U16,
    /// Number of entries.
    pub count: U32,
}
const _: () = assert!(size_of::<SectionHeader>() == 8);

/// Head of a heartbeat frame, after the frame header (16 B).
#[repr(C)]
#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned, Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeartbeatHead {
    /// Bytes of this head (≥ 16); sections start after it.
    pub head_len: U32,
    /// Number of sections that follow.
    pub section_count: U32,
    /// When the counters were snapshotted, ns, host monotonic (the header's `ts_ns` is
    /// the send time).
    pub snapshot_ns: U64,
}
const _: () = assert!(size_of::<HeartbeatHead>() == 16);

/// Head of a session_start frame, after the frame header (16 B).
#[repr(C)]
#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned, Clone, Copy, Debug, PartialEq, Eq)]
pub struct SessionStartHead {
    /// Bytes of this head (≥ 16).
    pub head_len: U32,
    /// Number of sections that follow.
    pub section_count: U32,
    /// The new shipper session (scopes `batch_seq`).
    pub shipper_session: U64,
}
const _: () = assert!(size_of::<SessionStartHead>() == 16);

/// Heartbeat `streams` entry: one (ring, CPU) stream's counters (96 B).
#[repr(C)]
#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned, Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamEntry {
    pub stream_id: U32,
    /// Highest ring fill since the last heartbeat, parts per million.
    pub fill_max_ppm: U32,
    /// Seqs taken so far in this epoch (exclusive bound: every seq below it was
    /// attempted).
    pub attempted_seq: U64,
    /// Drops by cause, slot = `LossCause` code − 1 (kernel slots 0–1, shipper the rest).
    pub drops: [U64; DROP_SLOTS],
    /// Events the sampler skipped before taking a seq.
    pub sampled_out: U64,
    /// The lowest seq of the stream the shipper still holds unacked (in a batch, or in
    /// a loss record's range), or `attempted_seq` when it holds none: below it every seq
    /// it read left its spool for good; at or above it frames or loss records may still
    /// come, so a gap there is in transit, not lost.
    pub held_from_seq: U64,
}
const _: () = assert!(size_of::<StreamEntry>() == 96);

impl StreamEntry {
    /// The stream.
    #[must_use]
    pub fn stream(&self) -> StreamId {
        StreamId(self.stream_id.get())
    }
    /// Drops counted for `cause` (0 for an unrecognised cause).
    #[must_use]
    pub fn drops_for(&self, cause: LossCause) -> u64 {
        cause.drop_slot().and_then(|slot| self.drops.get(slot)).map_or(0, |v| v.get())
    }
}

/// Heartbeat `progress` entry: one rank's PROGRESS map value (104 B).
#[repr(C)]
#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned, Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProgressEntry {
    pub comm_hash: U64,
    pub comm_disambiguator: U64,
    pub comm_instance: U64,
    /// cgroup v2 id of the rank's process (pod identity).
    pub cgroup_id: U64,
    /// Highest `comm_op_seq` this rank enqueued on this communicator (0 = none).
    pub last_enqueued_op: U64,
    /// Highest `comm_op_seq` whose kernel this rank's GPU started.
    pub last_kernel_started_op: U64,
    /// Highest `comm_op_seq` this rank completed (rank-level kernel_end/proxy_done).
    pub last_completed_op: U64,
    /// When the entry last changed, ns, host monotonic.
    pub last_update_ns: U64,
    /// GPU UUID (CUDA ordinals are container-relative; this is the identity).
    pub gpu_uuid: [u8; 16],
    pub rank: U32,
    pub pid: U32,
    /// Exit code when `proc_state` is exited.
    pub exit_code: I32,
    /// NCCL profiler activation mask in force (which event kinds are reported).
    pub activation_mask: U32,
    /// [`ProcState`] code.
    pub proc_state: u8,
    pub _reserved0: [u8; 7],
}
const _: () = assert!(size_of::<ProgressEntry>() == 104);

impl ProgressEntry {
    /// The communicator identity.
    #[must_use]
    pub fn comm(&self) -> CommKey {
        CommKey {
            comm_hash: self.comm_hash.get(),
            comm_disambiguator: self.comm_disambiguator.get(),
            comm_instance: self.comm_instance.get(),
        }
    }
    /// The process state.
    #[must_use]
    pub fn proc_state(&self) -> ProcState {
        ProcState::from_code(self.proc_state)
    }
}

/// Heartbeat `clock_realtime` entry: a paired read of host monotonic and realtime (16 B).
#[repr(C)]
#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned, Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClockRealtimeEntry {
    pub mono_ns: U64,
    pub realtime_ns: U64,
}
const _: () = assert!(size_of::<ClockRealtimeEntry>() == 16);

/// Heartbeat `clock_gpu` entry: a paired read of a GPU's global timer and host
/// monotonic (32 B).
#[repr(C)]
#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned, Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClockGpuEntry {
    pub gpu_uuid: [u8; 16],
    pub gpu_ns: U64,
    pub mono_ns: U64,
}
const _: () = assert!(size_of::<ClockGpuEntry>() == 32);

/// Heartbeat `shipper_state` entry (32 B).
#[repr(C)]
#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned, Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShipperStateEntry {
    pub spool_bytes: U64,
    pub spool_cap_bytes: U64,
    /// cgroup `memory.pressure` some avg10, parts per million.
    pub psi_some_avg10_ppm: U32,
    /// cgroup `memory.pressure` full avg10, parts per million.
    pub psi_full_avg10_ppm: U32,
    /// 0 = nothing shed, 1 = P3 shed, 2 = P2 shed, 3 = P1 coalesced.
    pub shed_tier: u8,
    /// Kernel bulk sampling level in force (0 = every event).
    pub sampling_level: u8,
    pub _reserved0: [u8; 6],
}
const _: () = assert!(size_of::<ShipperStateEntry>() == 32);

/// [`OwnerEntry::flags`]: the pod UID is known.
pub const OWNER_POD: u32 = 1;
/// [`OwnerEntry::flags`]: the container id is known.
pub const OWNER_CONTAINER: u32 = 1 << 1;
/// [`OwnerEntry::flags`]: the Slurm job id is known.
pub const OWNER_SLURM_JOB: u32 = 1 << 2;

/// Heartbeat `owner` entry: who owns a rank process, from its cgroup (64 B). A field is
/// meaningful only when its flag is set.
#[repr(C)]
#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned, Clone, Copy, Debug, PartialEq, Eq)]
pub struct OwnerEntry {
    /// The process (as in the `progress` entries of the same heartbeat).
    pub pid: U32,
    /// `OWNER_*` bits.
    pub flags: U32,
    pub slurm_job_id: U64,
    /// Kubernetes pod UID, RFC 4122 byte order.
    pub pod_uid: [u8; 16],
    /// Container id: the runtime's 64 hex digits as 32 bytes.
    pub container_id: [u8; 32],
}
const _: () = assert!(size_of::<OwnerEntry>() == 64);

/// [`InterfaceEntry::ifindex`] of the entry that counts the packets the kernel's
/// per-interface map could not take (it holds [`crate::kernel::MAX_INTERFACES`]; an
/// entry that could not be created, full map or not, counts here); never a real
/// interface's index.
pub const IFINDEX_OVERFLOW: u32 = 0;

/// Heartbeat `interfaces` entry: one network interface's packets and bytes as the bulk
/// XDP program counted them this epoch — every packet, before sampling and before the
/// ring, so they hold whatever the telemetry lost (24 B).
#[repr(C)]
#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned, Clone, Copy, Debug, PartialEq, Eq)]
pub struct InterfaceEntry {
    /// The interface's index on the node, or [`IFINDEX_OVERFLOW`].
    pub ifindex: U32,
    pub _reserved0: U32,
    /// Packets seen this epoch (running total).
    pub packets: U64,
    /// Their bytes (the XDP frame's length: from the L2 header on).
    pub bytes: U64,
}
const _: () = assert!(size_of::<InterfaceEntry>() == 24);

/// session_start `session_streams` entry: a stream's `attempted_seq` at takeover (16 B).
#[repr(C)]
#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned, Clone, Copy, Debug, PartialEq, Eq)]
pub struct SessionStreamEntry {
    pub stream_id: U32,
    pub _reserved0: [u8; 4],
    /// The kernel counter when the new session took over (exclusive bound).
    pub attempted_seq: U64,
}
const _: () = assert!(size_of::<SessionStreamEntry>() == 16);

/// Batch `stream_summary` entry: what the batch holds of one stream (40 B).
#[repr(C)]
#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned, Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamSummaryEntry {
    pub stream_id: U32,
    /// Frames of this stream in the batch.
    pub frame_count: U32,
    /// Lowest seq of the stream in the batch.
    pub first_seq: U64,
    /// Highest seq.
    pub last_seq: U64,
    /// Earliest `ts_ns`.
    pub first_ts: U64,
    /// Latest `ts_ns`.
    pub last_ts: U64,
}
const _: () = assert!(size_of::<StreamSummaryEntry>() == 40);

impl StreamSummaryEntry {
    /// The stream.
    #[must_use]
    pub fn stream(&self) -> StreamId {
        StreamId(self.stream_id.get())
    }
}

/// An entry type with a known section tag.
pub trait Entry: Sized + FromBytes + IntoBytes + KnownLayout + Immutable + Unaligned {
    /// Its tag.
    const TAG: SectionTag;
}
impl Entry for InterfaceEntry {
    const TAG: SectionTag = SectionTag::Interfaces;
}
impl Entry for StreamEntry {
    const TAG: SectionTag = SectionTag::Streams;
}
impl Entry for ProgressEntry {
    const TAG: SectionTag = SectionTag::Progress;
}
impl Entry for ClockRealtimeEntry {
    const TAG: SectionTag = SectionTag::ClockRealtime;
}
impl Entry for ClockGpuEntry {
    const TAG: SectionTag = SectionTag::ClockGpu;
}
impl Entry for ShipperStateEntry {
    const TAG: SectionTag = SectionTag::ShipperState;
}
impl Entry for SessionStreamEntry {
    const TAG: SectionTag = SectionTag::SessionStreams;
}
impl Entry for StreamSummaryEntry {
    const TAG: SectionTag = SectionTag::StreamSummary;
}
impl Entry for OwnerEntry {
    const TAG: SectionTag = SectionTag::Owner;
}

/// The v1 entry size of a known tag (`None` for tags readers skip).
#[must_use]
pub fn v1_entry_len(tag: SectionTag) -> Option<usize> {
    Some(match tag {
        SectionTag::Streams => size_of::<StreamEntry>(),
        SectionTag::Progress => size_of::<ProgressEntry>(),
        SectionTag::ClockRealtime => size_of::<ClockRealtimeEntry>(),
        SectionTag::ClockGpu => size_of::<ClockGpuEntry>(),
        SectionTag::ShipperState => size_of::<ShipperStateEntry>(),
        SectionTag::SessionStreams => size_of::<SessionStreamEntry>(),
        SectionTag::StreamSummary => size_of::<StreamSummaryEntry>(),
        SectionTag::Owner => size_of::<OwnerEntry>(),
        SectionTag::Interfaces => size_of::<InterfaceEntry>(),
        SectionTag::Unrecognized(_) => return None,
    })
}

/// The entries of one section, read by prefix. Construct through [`parse_section`],
/// which checks `entry_len` and bounds.
#[derive(Debug, Clone, Copy)]
pub struct Entries<'a, T> {
    bytes: &'a [u8],
    entry_len: usize,
    _t: PhantomData<&'a T>,
}

impl<'a, T: Entry> Entries<'a, T> {
    /// Number of entries.
    #[must_use]
    pub fn len(&self) -> usize {
        self.bytes.len().checked_div(self.entry_len).unwrap_or(0)
    }
    /// Whether there are none.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }
    /// Iterate the entries' v1 prefixes.
    pub fn iter(&self) -> impl Iterator<Item = &'a T> + 'a {
        let entry_len = self.entry_len.max(1);
        self.bytes.chunks_exact(entry_len).filter_map(|chunk| T::ref_from_prefix(chunk).ok().map(|(entry, _)| entry))
    }
}

/// A section's entries, typed by tag.
#[derive(Debug, Clone, Copy)]
pub enum Section<'a> {
    Streams(Entries<'a, StreamEntry>),
    Progress(Entries<'a, ProgressEntry>),
    ClockRealtime(Entries<'a, ClockRealtimeEntry>),
    ClockGpu(Entries<'a, ClockGpuEntry>),
    ShipperState(Entries<'a, ShipperStateEntry>),
    SessionStreams(Entries<'a, SessionStreamEntry>),
    StreamSummary(Entries<'a, StreamSummaryEntry>),
    Owner(Entries<'a, OwnerEntry>),
    Interfaces(Entries<'a, InterfaceEntry>),
    /// A tag this version does not know: skipped, reported so it can be counted.
    Unknown {
        tag: u16,
        entry_len: u16,
        count: u32,
    },
}

/// Splits one section off the front of `bytes`: `(header, entries bytes, rest)`.
/// Checks the entry length against the tag's v1 size and the bounds.
pub fn split_section(bytes: &[u8]) -> Result<(SectionHeader, &[u8], &[u8]), DecodeError> {
    let (sh, rest) = SectionHeader::read_from_prefix(bytes).map_err(|_| DecodeError::TooShort {
        what: "section header",
        need: size_of::<SectionHeader>(),
        got: bytes.len(),
    })?;
    let tag = SectionTag::from_code(sh.tag.get());
    let entry_len = usize::from(sh.entry_len.get());
    if let Some(v1) = v1_entry_len(tag)
        && entry_len < v1
    {
        return Err(DecodeError::TooShort { what: "section entry", need: v1, got: entry_len });
    }
    let count = usize::try_from(sh.count.get()).unwrap_or(usize::MAX);
    let body_len = entry_len.checked_mul(count).ok_or(DecodeError::LengthMismatch {
        what: "section",
        declared: usize::MAX,
        actual: rest.len(),
    })?;
    if body_len > rest.len() {
        return Err(DecodeError::LengthMismatch { what: "section", declared: body_len, actual: rest.len() });
    }
    let (body, rest) = rest.split_at(body_len);
    Ok((sh, body, rest))
}

/// Types a section's checked entries by tag.
#[must_use]
pub fn typed_section<'a>(sh: &SectionHeader, body: &'a [u8]) -> Section<'a> {
    fn entries<'a, T: Entry>(body: &'a [u8], sh: &SectionHeader) -> Entries<'a, T> {
        Entries { bytes: body, entry_len: usize::from(sh.entry_len.get()), _t: PhantomData }
    }
    match SectionTag::from_code(sh.tag.get()) {
        SectionTag::Streams => Section::Streams(entries(body, sh)),
        SectionTag::Progress => Section::Progress(entries(body, sh)),
        SectionTag::ClockRealtime => Section::ClockRealtime(entries(body, sh)),
        SectionTag::ClockGpu => Section::ClockGpu(entries(body, sh)),
        SectionTag::ShipperState => Section::ShipperState(entries(body, sh)),
        SectionTag::SessionStreams => Section::SessionStreams(entries(body, sh)),
        SectionTag::StreamSummary => Section::StreamSummary(entries(body, sh)),
        SectionTag::Owner => Section::Owner(entries(body, sh)),
        SectionTag::Interfaces => Section::Interfaces(entries(body, sh)),
        SectionTag::Unrecognized(tag) => Section::Unknown { tag, entry_len: sh.entry_len.get(), count: sh.count.get() },
    }
}

/// Parses one section of the expected entry type from the front of `bytes`.
pub fn parse_section<T: Entry>(bytes: &[u8]) -> Result<(Entries<'_, T>, &[u8]), DecodeError> {
    if let Ok((sh, _)) = SectionHeader::ref_from_prefix(bytes)
        && SectionTag::from_code(sh.tag.get()) != T::TAG
    {
        return Err(DecodeError::UnexpectedSection { expected: T::TAG.code(), got: sh.tag.get() });
    }
    let (sh, body, rest) = split_section(bytes)?;
    Ok((Entries { bytes: body, entry_len: usize::from(sh.entry_len.get()), _t: PhantomData }, rest))
}

/// A head that leads a sectioned frame.
pub trait SectionedHead: Sized + FromBytes + KnownLayout + Immutable + Unaligned {
    /// What to call it in errors.
    const WHAT: &'static str;
    /// Declared head length.
    fn head_len(&self) -> u32;
    /// Declared number of sections.
    fn section_count(&self) -> u32;
}
impl SectionedHead for HeartbeatHead {
    const WHAT: &'static str = "heartbeat head";
    fn head_len(&self) -> u32 {
        self.head_len.get()
    }
    fn section_count(&self) -> u32 {
        self.section_count.get()
    }
}
impl SectionedHead for SessionStartHead {
    const WHAT: &'static str = "session_start head";
    fn head_len(&self) -> u32 {
        self.head_len.get()
    }
    fn section_count(&self) -> u32 {
        self.section_count.get()
    }
}

/// A checked sectioned frame: a heartbeat or a session_start.
#[derive(Debug, Clone, Copy)]
pub struct Sectioned<'a, H> {
    /// The frame header.
    pub header: &'a FrameHeader,
    /// The head's v1 prefix.
    pub head: &'a H,
    sections: &'a [u8],
    section_count: u32,
}

/// A heartbeat frame.
pub type Heartbeat<'a> = Sectioned<'a, HeartbeatHead>;
/// A session_start frame.
pub type SessionStart<'a> = Sectioned<'a, SessionStartHead>;

impl<'a, H: SectionedHead> Sectioned<'a, H> {
    /// Checks the head and every section's bounds. `frame` is the whole frame
    /// (`header.length` bytes).
    pub fn parse(header: &'a FrameHeader, frame: &'a [u8]) -> Result<Self, DecodeError> {
        let body = frame.get(size_of::<FrameHeader>()..).unwrap_or(&[]);
        let (head, _) = H::ref_from_prefix(body).map_err(|_| DecodeError::TooShort {
            what: H::WHAT,
            need: size_of::<H>(),
            got: body.len(),
        })?;
        let head_len = usize::try_from(head.head_len()).unwrap_or(usize::MAX);
        if head_len < size_of::<H>() {
            return Err(DecodeError::TooShort { what: H::WHAT, need: size_of::<H>(), got: head_len });
        }
        let sections = body.get(head_len..).ok_or(DecodeError::LengthMismatch {
            what: H::WHAT,
            declared: head_len,
            actual: body.len(),
        })?;
        let mut rest = sections;
        for _ in 0..head.section_count() {
            let (_, _, after) = split_section(rest)?;
            rest = after;
        }
        // Trailing bytes after the last section: only the frame's padding to 8 is allowed.
        if rest.len() >= crate::header::FRAME_ALIGN {
            return Err(DecodeError::LengthMismatch {
                what: "sections",
                declared: sections.len().saturating_sub(rest.len()),
                actual: sections.len(),
            });
        }
        Ok(Self { header, head, sections, section_count: head.section_count() })
    }

    /// The sections, in order (bounds were checked by `parse`).
    pub fn sections(&self) -> impl Iterator<Item = Section<'a>> + 'a {
        let mut rest = self.sections;
        let mut left = self.section_count;
        core::iter::from_fn(move || {
            if left == 0 {
                return None;
            }
            left -= 1;
            let (sh, body, after) = split_section(rest).ok()?;
            rest = after;
            Some(typed_section(&sh, body))
        })
    }
}

/// Convenience: the stream of a session entry.
impl SessionStreamEntry {
    /// The stream.
    #[must_use]
    pub fn stream(&self) -> StreamId {
        StreamId(self.stream_id.get())
    }
}
