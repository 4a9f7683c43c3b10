//! The whole shipper as one pure state machine: batcher + spool + the frames the shipper
//! writes itself (heartbeats, loss records, epoch starts) + ack/nack handling.
//!
//! Method groups and call order (time is an argument, in the driver's monotonic ns):
//! - inputs: [`ShipperCore::handle_frame`] (a ring record), [`ShipperCore::handle_epoch`],
//!   [`ShipperCore::handle_counters`] (kernel counters, after every frame they cover was
//!   handed in), [`ShipperCore::handle_ack`] / [`ShipperCore::handle_nack`] /
//!   [`ShipperCore::handle_hello`] (control messages), [`ShipperCore::reconnected`],
//!   [`ShipperCore::set_pressure`] (memory pressure: bulk limited, shed as `psi_shed`);
//! - timers: [`ShipperCore::poll_timeout`] then [`ShipperCore::handle_timeout`];
//! - outputs: [`ShipperCore::poll_transmit`] (the next batch to put on the wire);
//! - at every connection: [`ShipperCore::resume`] (where the session stands, sent right
//!   after the control preface);
//! - shutdown: [`ShipperCore::flush`], then [`ShipperCore::unacked`] /
//!   [`ShipperCore::abandon`] at the deadline.
//!
//! Invariants:
//! - every frame handed in is in a batch that is acked, or named in a loss record (spool
//!   full, rejected), or reported by [`ShipperCore::abandon`] at shutdown; the counters
//!   say which, so `frames_in = acked + lost + abandoned + in spool/batcher` always;
//! - a heartbeat's `held_from_seq` is the lowest seq of the stream still held unacked
//!   (a batch, or a loss record's range), or `attempted_seq`: the batcher is flushed
//!   before every heartbeat, so nothing read is outside the spool when it is computed.

use std::collections::BTreeMap;

use proto_flat::batch::BatchView;
use proto_flat::codes::{AckStatus, Class, Durability, LossCause, NackReason, WireEnum};
use proto_flat::control::{MAX_RESUME_RANGES, MAX_RESUME_STREAMS};
use proto_flat::decode::Frame;
use proto_flat::encode::SectionedFrameWriter;
use proto_flat::frames::{EpochStartFrame, FixedFrame};
use proto_flat::header::StreamId;
use proto_flat::sections::{ProgressEntry, SessionStreamEntry, ShipperStateEntry, StreamEntry};
use zerocopy::little_endian::{U32, U64};
use zerocopy::{FromBytes, FromZeros, IntoBytes};

use super::batcher::{Batch, Batcher, BatcherConfig, SessionMeta, StageTimes, Staged};
use super::loss::{LostRange, lost_ranges};
use super::spool::{Spool, SpoolConfig};
use ringwatch_transport::pressure::Level;

/// Memory pressure as the shipper's PSI watcher sees it; heartbeats carry it
/// (`shipper_state`: `shed_tier` and the two `avg10`s).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Pressure {
    pub level: Level,
    pub some_avg10_ppm: u32,
    pub full_avg10_ppm: u32,
}

impl Pressure {
    /// The heartbeat's `shed_tier`: 0 nothing shed, 2 P2 (and P3) shed, 3 P1 coalesced
    /// too. (1, P3 alone, is never sent: every pressured level sheds P2.)
    #[must_use]
    pub const fn shed_tier(&self) -> u8 {
        match self.level {
            Level::Nominal => 0,
            Level::Some => 2,
            Level::Full => 3,
        }
    }
}

/// The shipper's own P1 stream: heartbeats, loss records, epoch starts.
pub const SHIPPER_STREAM: StreamId = StreamId::new(Class::P1, StreamId::SHIPPER_RING, 0);

/// Limits and timers of the core.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CoreConfig {
    pub batcher: BatcherConfig,
    pub spool: SpoolConfig,
    pub heartbeat_interval_ns: u64,
    /// Bulk's share of the connection send window (window − P0/P1 reserve).
    pub bulk_window_bytes: usize,
    /// Keep a log of every batch's fate (tests; bounded by [`BATCH_LOG_CAP`]).
    pub batch_log: bool,
    /// A lane with batches in flight and no ack for this long is sent again on the same
    /// connection (a stalled stream must not hold its batches forever).
    pub lane_stall_ns: u64,
}

/// Entries a batch log keeps; later ones are counted, not kept.
pub const BATCH_LOG_CAP: usize = 4 << 20;

/// One step in a batch's life (the batch log, for tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BatchEvent {
    Created {
        batch_seq: u64,
        lane: u8,
        frames: u32,
    },
    /// Put on the wire on the `connection`-th connection of this session.
    Sent {
        batch_seq: u64,
        connection: u64,
    },
    /// Acked by the aggregator instance that said `hello` on this connection.
    Acked {
        batch_seq: u64,
        aggregator_instance: u64,
    },
    Nacked {
        batch_seq: u64,
        reason: u16,
    },
    /// Left the spool undelivered: named in loss records (P1: counted in the totals).
    Lost {
        batch_seq: u64,
        cause: u16,
    },
    /// Unacked at the shutdown deadline.
    Abandoned {
        batch_seq: u64,
    },
    /// Acked `durable` (a snapshot on disk holds it) by that aggregator instance; or,
    /// with `aggregator_instance` 0, released unconfirmed (room was needed, or the
    /// aggregator declared durability `none`).
    Durable {
        batch_seq: u64,
        aggregator_instance: u64,
    },
}

impl Default for CoreConfig {
    fn default() -> Self {
        Self {
            batcher: BatcherConfig::default(),
            spool: SpoolConfig::default(),
            heartbeat_interval_ns: 1_000_000_000,
            bulk_window_bytes: 8 << 20,
            batch_log: false,
            lane_stall_ns: 5_000_000_000,
        }
    }
}

/// A new kernel-counter epoch, as the source reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EpochStart {
    pub epoch: u64,
    pub boot_id: [u8; 16],
    /// Node monotonic time the counters were created.
    pub mono_ns: u64,
    pub start_realtime_ns: u64,
}

/// Kernel counters at one instant: what a heartbeat carries.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SourceCounters {
    pub epoch: u64,
    /// Node monotonic time of the read.
    pub mono_ns: u64,
    /// Per (ring, CPU) stream: attempted_seq, drops by cause, sampled_out, fill.
    pub streams: Vec<StreamEntry>,
    /// PROGRESS entries, one per (rank, communicator).
    pub progress: Vec<ProgressEntry>,
    /// Who owns the processes PROGRESS names (pod, container, Slurm job), where known:
    /// filled by the reader ([`super::owner::OwnerCache`]), not by sources.
    pub owners: Vec<proto_flat::sections::OwnerEntry>,
    /// Per network interface, the packets and bytes the bulk producer saw this epoch
    /// (every packet, before sampling), in ifindex order; empty where the source has no
    /// interfaces.
    pub interfaces: Vec<proto_flat::sections::InterfaceEntry>,
}

/// What the core counted (served by the shipper's `/metrics`; printed at shutdown).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ShipperStats {
    /// Ring records handed in.
    pub frames_in: u64,
    /// Ring records that were not a frame (bad length or lane): counted, not shipped.
    pub frames_malformed: u64,
    /// Frames put into each lane's batches (P0, P1, P2, P3): ring frames, and in P1 the
    /// shipper's own (heartbeats, loss records, session and epoch starts). Per lane,
    /// `frames_in_by_lane = frames_acked_by_lane + frames_lost_by_lane + unflushed`.
    pub frames_in_by_lane: [u64; 4],
    /// Frames of batches that left the spool unacked (evicted, refused, nacked, given up
    /// at shutdown), per lane.
    pub frames_lost_by_lane: [u64; 4],
    pub batches_cut: u64,
    pub heartbeats: u64,
    /// Heartbeats sent under `full` memory pressure, each standing for two intervals
    /// (P1 coalesced).
    pub heartbeats_coalesced: u64,
    /// `session_start` frames (a takeover of pinned kernel counters).
    pub session_starts: u64,
    pub loss_records: u64,
    /// Frames of batches acked by the aggregator, all lanes.
    pub frames_acked: u64,
    /// The same per lane (P0, P1, P2, P3): ring frames travel in P0/P2/P3, the
    /// shipper's own (heartbeats, loss records) in P1.
    pub frames_acked_by_lane: [u64; 4],
    /// Ring frames named in loss records, by cause slot.
    pub frames_lost: [u64; proto_flat::codes::DROP_SLOTS],
    /// Of `frames_lost`, those in batches already sent when they were given up (shed or
    /// evicted in flight): they may still arrive and be applied, and the aggregator then
    /// counts them received (its loss record for them names the batch and is ignored).
    pub frames_lost_after_send: [u64; proto_flat::codes::DROP_SLOTS],
    /// The shipper's own P1 frames in batches that were dropped (counted in the running
    /// totals every envelope carries; never loss records about themselves).
    pub own_frames_lost: u64,
    pub batches_acked: u64,
    pub batches_nacked: u64,
    /// Nacks by reason code (the last 16 codes; an unknown code counts in slot 0).
    pub nacks_by_reason: [u64; 16],
    /// Ring frames the reader shed before they reached the spool (its queue to the core
    /// was full), and the staged batches they were in; also counted in `frames_lost`
    /// (`shipper_spool_full`) and `frames_lost_by_lane`.
    pub frames_shed: u64,
    pub batches_shed: u64,
    /// Batches whose loss records could not be built (corrupted spool bytes).
    pub loss_record_errors: u64,
    pub hellos: u64,
    /// Lanes sent again because their acks stalled (and per lane: the driver resets the
    /// streams still carrying a resent lane's batches, so they do not hold the
    /// connection's send window twice).
    pub lane_resends: u64,
    pub lane_resends_by_lane: [u64; 4],
    /// Batches sent again because their stream failed or the aggregator stopped it.
    pub send_failures: u64,
    /// The aggregator instance of the last hello.
    pub aggregator_instance: u64,
    pub aggregator_epoch: u64,
    /// The last hello's control protocol and durability (`Durability` code).
    pub control_version: u16,
    pub durability: u8,
    /// P0/P1 batches acked `durable` after an applied ack (durability `snapshot`) …
    pub batches_durable: u64,
    /// … and those released before a durable ack came: room was needed, or an
    /// aggregator declaring durability `none` answered (they were applied; an aggregator
    /// crash before its next snapshot would lose them).
    pub released_undurable: u64,
}

/// Batch latency (first frame in → ack) per lane, microseconds; and for P0/P1 batches
/// kept until durable, first frame in → durable ack (the durable lag).
#[derive(Debug, Clone)]
pub struct LaneLatency {
    /// P0, P1, P2, P3.
    pub lanes: [hdrhistogram::Histogram<u64>; 4],
    pub durable: hdrhistogram::Histogram<u64>,
    /// Per stage of delivered batches ([`STAGES`]), microseconds.
    pub stages: [hdrhistogram::Histogram<u64>; 4],
}

/// The stages of a batch's way, as the stage latency histograms name them: `read`
/// (its first frame's kernel timestamp → the drain pass that read it; bulk batches of
/// sources that keep the node's monotonic clock), `batch` (→ sealed into the spool's order: the batch
/// filled or its flush interval passed, and the reader's queue to the core), `send`
/// (→ first handed to the network: the spool's order and window), `ack` (→ the
/// aggregator's applied ack).
pub const STAGES: [&str; 4] = ["read", "batch", "send", "ack"];

impl Default for LaneLatency {
    fn default() -> Self {
        // 1 µs .. 1 h at 2 significant digits: a few KiB each.
        let h = || hdrhistogram::Histogram::new_with_bounds(1, 3_600_000_000, 2).expect("constant bounds are valid");
        Self { lanes: [h(), h(), h(), h()], durable: h(), stages: [h(), h(), h(), h()] }
    }
}

/// The percentiles of one lane's latency, microseconds (all 0 when nothing was acked).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct LatencySummary {
    pub count: u64,
    pub p50_us: u64,
    pub p99_us: u64,
    pub max_us: u64,
}

impl LaneLatency {
    /// The summary of `lane`.
    #[must_use]
    pub fn summary(&self, lane: Class) -> LatencySummary {
        let Some(h) = self.lanes.get(usize::from(lane.code())) else { return LatencySummary::default() };
        Self::summarize(h)
    }

    /// The durable lag's summary (P0/P1 batches acked durable).
    #[must_use]
    pub fn durable_summary(&self) -> LatencySummary {
        Self::summarize(&self.durable)
    }

    fn summarize(h: &hdrhistogram::Histogram<u64>) -> LatencySummary {
        LatencySummary {
            count: h.len(),
            p50_us: h.value_at_quantile(0.5),
            p99_us: h.value_at_quantile(0.99),
            max_us: h.max(),
        }
    }
}

/// What was still unacked at the shutdown deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Unflushed {
    pub batches: u64,
    pub frames: u64,
    pub bytes: u64,
    /// Per lane (P0, P1, P2, P3).
    pub batches_by_lane: [u64; 4],
    pub frames_by_lane: [u64; 4],
}

/// Appends to an enabled batch log, counting what its cap turns away.
fn push_log(log: &mut Option<Vec<BatchEvent>>, overflow: &mut u64, e: BatchEvent) {
    if let Some(log) = log {
        if log.len() < BATCH_LOG_CAP {
            log.push(e);
        } else {
            *overflow += 1;
        }
    }
}

/// The shipper core. See the module docs.
#[derive(Debug)]
pub struct ShipperCore {
    config: CoreConfig,
    batcher: Batcher,
    spool: Spool,
    /// Next seq on the shipper's own stream (per epoch).
    p1_seq: u64,
    /// The shipper's own P1 stream: [`SHIPPER_STREAM`], or another index of it when the
    /// epoch outlives shipper sessions (pinned kernel counters).
    shipper_stream: StreamId,
    next_heartbeat_ns: u64,
    counters: SourceCounters,
    sampling_level: u8,
    /// The node's monotonic clock as last handed in (a `resume`'s clock sample).
    node_mono_ns: u64,
    stats: ShipperStats,
    /// Batches cut but not yet offered to the spool (offering can cut more: loss records).
    cut: Vec<Batch>,
    /// Loss records wait in the open P1 lane: cut it once the current offers are done.
    pending_loss_records: bool,
    latency: LaneLatency,
    /// The aggregator declared durability `snapshot`: applied P0/P1 batches stay until
    /// acked durable.
    keep_until_durable: bool,
    /// Connections so far (the batch log's `Sent::connection`).
    connections: u64,
    /// Per lane: when it last made progress (an ack, or idle with nothing in flight).
    lane_progress_ns: [u64; 4],
    batch_log: Option<Vec<BatchEvent>>,
    batch_log_overflow: u64,
    /// Per `(epoch, stream_id)`: one past the highest seq of the stream in a batch that
    /// left the spool acked (its frames, or a loss record's range) — the `resume` floor. At most
    /// [`MAX_RESUME_STREAMS`] entries; more are counted in `resume_streams_dropped`.
    released: BTreeMap<(u64, u32), u64>,
    resume_streams_dropped: u64,
    /// Ranges of ring frames lost in batches that were never sent (evicted before their
    /// turn, or shed by the reader), merged per stream while they stay contiguous;
    /// written as loss records before the next heartbeat (its `held_from_seq` then
    /// covers them), when [`MAX_COALESCED`] are pending, and at shutdown. Under a long
    /// overload one record per stream per heartbeat, not one per batch: the records
    /// must not flood a link that is already too slow for the data.
    coalesced: Vec<LostRange>,
    pressure: Pressure,
}

/// Merged loss ranges the core holds before it writes them out.
const MAX_COALESCED: usize = 1024;

/// What a `resume` says (see [`ShipperCore::resume`]).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ResumeState {
    pub shipper_session: u64,
    pub epoch: u64,
    pub next_batch_seq: u64,
    /// The node's monotonic clock as last handed to the core (by the reader's last turn):
    /// the `resume`'s fresh clock sample.
    pub sent_ns: u64,
    /// Held `batch_seq`s, inclusive ranges, ascending.
    pub held: Vec<(u64, u64)>,
    /// `(stream_id, floor_seq)` of the current epoch.
    pub floors: Vec<(u32, u64)>,
}

impl ShipperCore {
    /// A core for one shipper session, started at `now`.
    #[must_use]
    pub fn new(config: CoreConfig, meta: SessionMeta, now: u64) -> Self {
        Self {
            config,
            batcher: Batcher::new(config.batcher, meta),
            spool: Spool::new(config.spool),
            p1_seq: 0,
            shipper_stream: SHIPPER_STREAM,
            next_heartbeat_ns: now + config.heartbeat_interval_ns,
            counters: SourceCounters::default(),
            sampling_level: 0,
            node_mono_ns: 0,
            stats: ShipperStats::default(),
            cut: Vec::new(),
            pending_loss_records: false,
            latency: LaneLatency::default(),
            keep_until_durable: false,
            connections: 0,
            lane_progress_ns: [now; 4],
            batch_log: config.batch_log.then(Vec::new),
            batch_log_overflow: 0,
            released: BTreeMap::new(),
            resume_streams_dropped: 0,
            coalesced: Vec::new(),
            pressure: Pressure::default(),
        }
    }

    // ---------------------------------------------------------------- getters

    /// Counters.
    #[must_use]
    pub fn stats(&self) -> &ShipperStats {
        &self.stats
    }

    /// The spool (counters, bytes held).
    #[must_use]
    pub fn spool(&self) -> &Spool {
        &self.spool
    }

    /// Session identity and running totals.
    #[must_use]
    pub fn batcher(&self) -> &Batcher {
        &self.batcher
    }

    /// When the next heartbeat is due.
    #[must_use]
    pub fn next_heartbeat_ns(&self) -> u64 {
        self.next_heartbeat_ns
    }

    /// The spool's cap.
    #[must_use]
    pub fn spool_cap_bytes(&self) -> usize {
        self.config.spool.cap_bytes
    }

    /// The latest kernel counters handed in.
    #[must_use]
    pub fn counters(&self) -> &SourceCounters {
        &self.counters
    }

    // ---------------------------------------------------------------- inputs

    /// One ring record, copied unparsed into its lane's open batch.
    pub fn handle_frame(&mut self, frame: &[u8], now: u64) {
        self.stats.frames_in += 1;
        self.push_into_lane(frame, now);
        self.offer_cut(now);
    }

    /// A batch the ring reader filled and cut ([`Staged`]): sealed (numbered, totals,
    /// checksum) and spooled. Its writer, emptied, goes back to the reader.
    pub fn handle_staged(&mut self, staged: &mut Staged, now: u64) {
        let frames = u64::from(staged.frames());
        let l = usize::from(staged.lane.code()).min(3);
        self.stats.frames_in += frames;
        self.stats.frames_in_by_lane[l] += frames;
        let b = self.batcher.seal(staged);
        self.cut.push(b);
        self.offer_cut(now);
    }

    /// Frames the ring reader shed before they reached the spool (its queue to the core
    /// was full: the core fell behind the ring): lost `shipper_spool_full`, one loss
    /// record per range, like a batch the spool evicted.
    pub fn handle_shed(&mut self, lane: Class, ranges: &[LostRange], now: u64) {
        let frames: u64 = ranges.iter().map(|r| r.count).sum();
        let l = usize::from(lane.code()).min(3);
        let cause = LossCause::ShipperSpoolFull;
        self.stats.frames_in += frames;
        self.stats.frames_in_by_lane[l] += frames;
        self.stats.frames_lost_by_lane[l] += frames;
        self.stats.frames_shed += frames;
        self.stats.batches_shed += 1;
        self.stats.frames_lost[cause.drop_slot().unwrap_or(0)] += frames;
        self.batcher.note_shed(frames);
        self.batcher.note_loss(cause, frames);
        for r in ranges {
            self.coalesce(r, now);
        }
        self.offer_cut(now);
    }

    /// Adds a never-sent batch's range to the merged ones (batch_seq 0: no batch of
    /// it can have been applied).
    fn coalesce(&mut self, r: &LostRange, now: u64) {
        LostRange::merge_into(&mut self.coalesced, LostRange { batch_seq: 0, ..*r });
        if self.coalesced.len() >= MAX_COALESCED {
            self.write_coalesced(now);
        }
    }

    /// Offers what is cut and writes every merged range as a record, until none is left
    /// (offering a P1 batch of records can evict bulk, which merges more).
    fn settle_losses(&mut self, now: u64) {
        loop {
            self.offer_cut(now);
            if self.coalesced.is_empty() {
                break;
            }
            self.write_coalesced(now);
        }
    }

    /// The merged ranges become loss records (in the open P1 lane, cut promptly).
    fn write_coalesced(&mut self, now: u64) {
        for r in std::mem::take(&mut self.coalesced) {
            self.loss_record(&r, now);
        }
    }

    /// Records the ring reader could not batch (bad length or lane): counted, in
    /// `frames_in` too (as [`Self::handle_frame`] counts them).
    pub fn note_malformed(&mut self, frames: u64) {
        self.stats.frames_in += frames;
        self.stats.frames_malformed += frames;
    }

    /// A new epoch: open batches of the old one are cut, the shipper stream restarts at
    /// seq 0 with an `epoch_start` frame.
    pub fn handle_epoch(&mut self, e: &EpochStart, now: u64) {
        let cut = self.batcher.set_epoch(e.epoch);
        self.cut.extend(cut);
        self.offer_cut(now);
        self.p1_seq = 0;
        let mut f = EpochStartFrame::new_zeroed();
        f.hdr = EpochStartFrame::make_header(0, self.shipper_stream, self.next_p1_seq(), e.mono_ns);
        f.epoch = U64::new(e.epoch);
        f.start_realtime_ns = U64::new(e.start_realtime_ns);
        f.boot_id = e.boot_id;
        self.push_into_lane(f.as_bytes(), now);
        // The old epoch's counters say nothing of the new one: a heartbeat before the
        // new epoch's first counters must not carry them (the aggregator would read the
        // old counts as the new streams' `attempted_seq`, which only ever grows, and wait
        // for frames that never come).
        self.counters = SourceCounters { epoch: e.epoch, mono_ns: e.mono_ns, ..SourceCounters::default() };
        // Floors of ended epochs are never sent again.
        self.released.retain(|&(epoch, _), _| epoch >= e.epoch);
    }

    /// A heartbeat now with the last counters (shutdown: once the spool is empty, so the
    /// aggregator learns that nothing is held any more and settles what is left).
    pub fn heartbeat_now(&mut self, node_mono_ns: u64, now: u64) {
        self.heartbeat(node_mono_ns, now);
    }

    /// Fresh kernel counters (every frame they count was handed in before). Sends a
    /// heartbeat at once: the aggregator's watermarks move with them.
    pub fn handle_counters(&mut self, counters: &SourceCounters, node_mono_ns: u64, now: u64) {
        self.counters.clone_from(counters);
        let sampled: u64 = counters.streams.iter().map(|s| s.sampled_out.get()).sum();
        self.batcher.set_sampled_out(sampled);
        self.heartbeat(node_mono_ns, now);
    }

    /// This session took over kernel counters an earlier session of the same epoch left
    /// running: a `session_start` names every stream's `attempted_seq` at the takeover
    /// (seqs below it that nobody ships are `shipper_restart` losses at the aggregator).
    /// Call before any frame of the session.
    pub fn handle_session_start(&mut self, streams: &[SessionStreamEntry], node_mono_ns: u64, now: u64) {
        let seq = self.next_p1_seq();
        let session = self.batcher.meta().shipper_session;
        let mut w = SectionedFrameWriter::session_start(self.shipper_stream, seq, node_mono_ns, session);
        w.section(streams);
        let frame = w.finish();
        self.push_into_lane(&frame, now);
        self.stats.session_starts += 1;
        self.pending_loss_records = true;
        self.offer_cut(now);
    }

    /// Uses P1 stream `index` of the shipper ring for this session's own frames (before
    /// the first frame: one stream per session of an epoch that outlives sessions).
    pub fn set_shipper_stream_index(&mut self, index: u16) {
        self.shipper_stream = StreamId::new(Class::P1, StreamId::SHIPPER_RING, index);
    }

    /// `hello` from the aggregator: which instance, the connection's control protocol,
    /// and what its acks promise. With durability `snapshot`, applied P0/P1 batches stay
    /// in the spool until acked `durable`; with `none` (or protocol 2), an applied ack is
    /// the last word, and whatever still awaited a durable ack leaves now.
    pub fn handle_hello(
        &mut self,
        aggregator_instance: u64,
        aggregator_epoch: u64,
        control_version: u16,
        durability: Durability,
    ) {
        self.stats.hellos += 1;
        self.stats.aggregator_instance = aggregator_instance;
        self.stats.aggregator_epoch = aggregator_epoch;
        self.stats.control_version = control_version;
        self.stats.durability = durability.code();
        self.keep_until_durable = matches!(durability, Durability::Snapshot | Durability::Jetstream);
        if !self.keep_until_durable {
            for b in self.spool.release_awaiting() {
                self.stats.released_undurable += 1;
                self.log(BatchEvent::Durable { batch_seq: b.batch_seq, aggregator_instance: 0 });
                self.note_released(&b.bytes);
                self.batcher.recycle(b.bytes);
            }
        }
    }

    /// The batch log (empty unless enabled), and how many entries did not fit.
    #[must_use]
    pub fn batch_log(&self) -> (&[BatchEvent], u64) {
        (self.batch_log.as_deref().unwrap_or(&[]), self.batch_log_overflow)
    }

    fn log(&mut self, e: BatchEvent) {
        push_log(&mut self.batch_log, &mut self.batch_log_overflow, e);
    }

    /// Batch latency (first frame in → ack) per lane.
    #[must_use]
    pub fn latency(&self) -> &LaneLatency {
        &self.latency
    }

    /// `ack` of inclusive `batch_seq` ranges. Applied (or duplicate): those batches are
    /// delivered and leave the spool — P0/P1 ones stay, awaiting a durable ack, while the
    /// aggregator declared durability `snapshot`. Durable: they leave the spool.
    pub fn handle_ack(&mut self, ranges: &[(u64, u64)], status: AckStatus, now: u64) {
        let instance = self.stats.aggregator_instance;
        if status == AckStatus::Durable {
            let (freed, unacked) = self.spool.durable(ranges);
            for b in freed {
                self.stats.batches_durable += 1;
                self.latency.durable.saturating_record((now.saturating_sub(b.opened_ns) / 1_000).max(1));
                self.log(BatchEvent::Durable { batch_seq: b.batch_seq, aggregator_instance: instance });
                self.note_released(&b.bytes);
                self.batcher.recycle(b.bytes);
            }
            for b in unacked {
                self.delivered(b.lane, b.batch_seq, b.frames, b.opened_ns, b.stages, now);
                self.stats.batches_durable += 1;
                self.log(BatchEvent::Durable { batch_seq: b.batch_seq, aggregator_instance: instance });
                self.note_released(&b.bytes);
                self.batcher.recycle(b.bytes);
            }
            return;
        }
        let (freed, kept) = self.spool.ack(ranges, self.keep_until_durable);
        for k in kept {
            self.delivered(k.lane, k.batch_seq, k.frames, k.opened_ns, k.stages, now);
        }
        for b in freed {
            self.delivered(b.lane, b.batch_seq, b.frames, b.opened_ns, b.stages, now);
            self.note_released(&b.bytes);
            self.batcher.recycle(b.bytes);
        }
    }

    /// A batch acked (applied, duplicate, or durable without an applied ack first): its
    /// frames are delivered.
    fn delivered(&mut self, lane: Class, batch_seq: u64, frames: u32, opened_ns: u64, stages: StageTimes, now: u64) {
        let l = usize::from(lane.code()).min(3);
        let us = |ns: u64| (ns / 1_000).max(1);
        if stages.read_ns > 0 {
            self.latency.stages[0].saturating_record(us(stages.read_ns));
        }
        if stages.cut_ns > 0 {
            self.latency.stages[1].saturating_record(us(stages.cut_ns.saturating_sub(opened_ns)));
            if stages.sent_ns > 0 {
                self.latency.stages[2].saturating_record(us(stages.sent_ns.saturating_sub(stages.cut_ns)));
                self.latency.stages[3].saturating_record(us(now.saturating_sub(stages.sent_ns)));
            }
        }
        if let Some(p) = self.lane_progress_ns.get_mut(l) {
            *p = now;
        }
        self.log(BatchEvent::Acked { batch_seq, aggregator_instance: self.stats.aggregator_instance });
        if let Some(h) = self.latency.lanes.get_mut(l) {
            h.saturating_record((now.saturating_sub(opened_ns) / 1_000).max(1));
        }
        self.stats.batches_acked += 1;
        self.stats.frames_acked += u64::from(frames);
        self.stats.frames_acked_by_lane[l] += u64::from(frames);
    }

    /// Where the session stands, for the `resume` sent right after the control preface
    /// of every connection: the held `batch_seq`s (everything below `next_batch_seq`
    /// not held left the spool for good) and each stream's floor (one past the highest
    /// seq of it that left the spool acked). An aggregator that restarted settles what it
    /// no longer needs to wait for. (Where this session took a stream over is not a
    /// floor: the gap below it is the last session's unshipped tail, `shipper_restart`,
    /// which the `session_start` frame tells the aggregator.)
    #[must_use]
    pub fn resume(&self) -> ResumeState {
        let mut seqs: Vec<u64> = self.spool.iter_held().map(|b| b.batch_seq).collect();
        seqs.sort_unstable();
        let mut held: Vec<(u64, u64)> = Vec::new();
        let mut next_batch_seq = self.batcher.next_batch_seq();
        for seq in seqs {
            if let Some(last) = held.last_mut().filter(|l| seq == l.1 + 1) {
                last.1 = seq;
            } else if held.len() == MAX_RESUME_RANGES {
                // Too fragmented to list: speak only up to the first range left out.
                next_batch_seq = seq;
                break;
            } else {
                held.push((seq, seq));
            }
        }
        let meta = self.batcher.meta();
        let floors = self.released.range((meta.epoch, 0)..=(meta.epoch, u32::MAX)).map(|(k, v)| (k.1, *v)).collect();
        ResumeState {
            shipper_session: meta.shipper_session,
            epoch: meta.epoch,
            next_batch_seq,
            sent_ns: self.node_mono_ns,
            held,
            floors,
        }
    }

    /// Resume floors that did not fit [`MAX_RESUME_STREAMS`].
    #[must_use]
    pub fn resume_streams_dropped(&self) -> u64 {
        self.resume_streams_dropped
    }

    fn raise_floor(&mut self, epoch: u64, stream_id: u32, floor: u64) {
        let len = self.released.len();
        match self.released.entry((epoch, stream_id)) {
            std::collections::btree_map::Entry::Occupied(mut e) => {
                let v = e.get_mut();
                *v = (*v).max(floor);
            }
            std::collections::btree_map::Entry::Vacant(v) if len < MAX_RESUME_STREAMS => {
                v.insert(floor);
            }
            std::collections::btree_map::Entry::Vacant(_) => self.resume_streams_dropped += 1,
        }
    }

    /// An acked batch's streams move their resume floors (per batch, never per frame:
    /// the stream summary for ring lanes; the frames of the shipper's own P1 batches, whose
    /// loss records speak for other streams).
    fn note_released(&mut self, bytes: &[u8]) {
        let Ok(view) = BatchView::parse_own(bytes) else { return };
        let epoch = view.header.epoch.get();
        if epoch < self.batcher.meta().epoch {
            return; // an ended epoch's floors are never sent again
        }
        if view.lane() == Class::P1 {
            for frame in view.frames() {
                let Ok(frame) = frame else { break };
                let h = frame.header();
                self.raise_floor(epoch, h.stream_id.get(), h.seq.get().saturating_add(1));
                if let Frame::LossRecord(r) = frame {
                    self.raise_floor(epoch, r.stream_id.get(), r.last_seq.get().saturating_add(1));
                }
            }
        } else {
            for e in view.summary.iter() {
                self.raise_floor(epoch, e.stream_id.get(), e.last_seq.get().saturating_add(1));
            }
        }
    }

    /// `nack`: the batch leaves the spool as `rejected(reason)` loss records, so a
    /// poisoned batch never loops.
    pub fn handle_nack(&mut self, batch_seq: u64, reason: NackReason, now: u64) {
        let Some(b) = self.spool.nack(batch_seq) else { return };
        self.log(BatchEvent::Nacked { batch_seq, reason: reason.code() });
        self.stats.batches_nacked += 1;
        let slot = usize::from(reason.code()).min(15);
        self.stats.nacks_by_reason[slot] += 1;
        self.lose(b, LossCause::Rejected, reason.code(), now);
        self.offer_cut(now);
    }

    /// A new connection: every unacked batch is sent again.
    pub fn reconnected(&mut self) {
        self.connections += 1;
        self.spool.reconnected();
    }

    /// The kernel sampling level last set.
    #[must_use]
    pub fn sampling_level(&self) -> u8 {
        self.sampling_level
    }

    /// The kernel bulk sampling level in force (reported in heartbeats).
    pub fn set_sampling_level(&mut self, level: u8) {
        self.sampling_level = level;
    }

    /// Memory pressure changed (or its averages moved): reported in heartbeats, and bulk
    /// held to `bulk_limit` bytes while it lasts (`None`: lifted). Bulk over a new limit
    /// leaves at once as loss records of cause `psi_shed`, like every bulk batch shed
    /// while it lasts; P0 and P1 are never shed.
    pub fn set_pressure(&mut self, pressure: Pressure, bulk_limit: Option<usize>, now: u64) {
        self.pressure = pressure;
        if self.spool.bulk_limit() == bulk_limit {
            return;
        }
        for b in self.spool.set_bulk_limit(bulk_limit) {
            self.lose(b, LossCause::PsiShed, 0, now);
        }
        self.offer_cut(now);
    }

    /// Memory pressure's P3 actions in the core: the batcher's pooled buffers freed and
    /// pooling stopped, the batch log (a diagnostic) stopped for good, its entries
    /// counted as not kept. Returns the buffer bytes freed.
    pub fn shed_p3(&mut self) -> usize {
        if let Some(log) = self.batch_log.take() {
            self.batch_log_overflow = self.batch_log_overflow.saturating_add(log.len() as u64);
        }
        self.batcher.set_pooling(false)
    }

    /// The batcher's buffer pool: capacity held now, and buffers its cap turned away.
    #[must_use]
    pub fn pool(&self) -> (usize, u64) {
        (self.batcher.pooled_bytes(), self.batcher.pool_turned_away())
    }

    /// Pressure eased: buffers are pooled again (the batch log stays off).
    pub fn restore_p3(&mut self) {
        self.batcher.set_pooling(true);
    }

    /// The pressure last handed in.
    #[must_use]
    pub const fn pressure(&self) -> Pressure {
        self.pressure
    }

    // ---------------------------------------------------------------- timers

    /// When [`Self::handle_timeout`] is next due.
    #[must_use]
    pub fn poll_timeout(&self) -> u64 {
        self.batcher.poll_timeout().map_or(self.next_heartbeat_ns, |t| t.min(self.next_heartbeat_ns))
    }

    /// Cuts batches whose flush interval passed; heartbeats when due (also when idle,
    /// with the last counters).
    pub fn handle_timeout(&mut self, node_mono_ns: u64, now: u64) {
        self.node_mono_ns = self.node_mono_ns.max(node_mono_ns);
        self.check_stalls(now);
        while let Some(b) = self.batcher.poll_cut(now) {
            self.cut.push(b);
        }
        self.offer_cut(now);
        if now >= self.next_heartbeat_ns {
            self.heartbeat(node_mono_ns, now);
        }
    }

    // ---------------------------------------------------------------- outputs

    /// The next batch to send (P0, then P1, then bulk within its window).
    pub fn poll_transmit(&mut self, now: u64) -> Option<(Class, u64, &[u8])> {
        let (lane, seq, bytes) = self.spool.next_to_send(self.config.bulk_window_bytes, now)?;
        // Disjoint fields: the spool stays borrowed for the bytes.
        push_log(
            &mut self.batch_log,
            &mut self.batch_log_overflow,
            BatchEvent::Sent { batch_seq: seq, connection: self.connections },
        );
        Some((lane, seq, bytes))
    }

    // ---------------------------------------------------------------- shutdown

    /// Cuts every open batch into the spool (shutdown, first step).
    pub fn flush(&mut self, now: u64) {
        let cut = self.batcher.flush();
        self.cut.extend(cut);
        self.settle_losses(now);
    }

    /// What is still waiting for an ack.
    #[must_use]
    pub fn unacked(&self) -> Unflushed {
        let mut u = Unflushed::default();
        for b in self.spool.iter() {
            let lane = usize::from(b.lane.code()).min(3);
            u.batches += 1;
            u.frames += u64::from(b.frames);
            u.bytes += b.bytes.len() as u64;
            u.batches_by_lane[lane] += 1;
            u.frames_by_lane[lane] += u64::from(b.frames);
        }
        u
    }

    /// Shutdown, once the flush deadline passed: every unacked ring-frame batch (P0 and
    /// bulk) is given up as `shipper_shutdown` loss records, which go out in P1 batches
    /// (small, sent first), so the aggregator accounts for them with their cause instead
    /// of waiting for frames that will never come. A report for a batch the aggregator
    /// applied after all (its ack still in flight) is ignored there. Returns the frames
    /// given up.
    pub fn give_up_data(&mut self, now: u64) -> u64 {
        let mut frames = 0;
        for b in self.spool.drain_lanes(&[Class::P0, Class::P2, Class::P3]) {
            frames += u64::from(b.frames);
            self.lose(b, LossCause::ShipperShutdown, 0, now);
        }
        self.settle_losses(now);
        frames
    }

    /// The shutdown deadline passed: whatever is unacked is given up and reported (it
    /// cannot be shipped any more; the next session's `session_start` or the
    /// aggregator's reorder timeout accounts for it there).
    pub fn abandon(&mut self) -> Unflushed {
        let u = self.unacked();
        for b in self.spool.drain() {
            self.log(BatchEvent::Abandoned { batch_seq: b.batch_seq });
            self.stats.frames_lost_by_lane[usize::from(b.lane.code()).min(3)] += u64::from(b.frames);
            if b.lane == Class::P1 {
                self.stats.own_frames_lost += u64::from(b.frames);
            }
            // Ring frames here are in no loss record: the returned `Unflushed` reports
            // them (the shutdown path names them in loss records first, `give_up_data`).
        }
        u
    }

    // ---------------------------------------------------------------- internals

    fn next_p1_seq(&mut self) -> u64 {
        self.p1_seq += 1;
        self.p1_seq - 1
    }

    /// Copies a frame into its lane's open batch (ring records and the shipper's own P1
    /// frames alike); a cut batch waits for `offer_cut`.
    fn push_into_lane(&mut self, frame: &[u8], now: u64) {
        let pushed = self.batcher.push(frame, now);
        if pushed.is_ok() {
            // The batcher accepted it, so the header parses.
            let lane = proto_flat::FrameHeader::read_from_prefix(frame)
                .map_or(3, |(h, _)| usize::from(h.stream().class_code()).min(3));
            self.stats.frames_in_by_lane[lane] += 1;
        }
        match pushed {
            Ok(Some(b)) => self.cut.push(b),
            Ok(None) => {}
            Err(_) => self.stats.frames_malformed += 1,
        }
    }

    /// Per stream of `epoch`, the lowest seq still held unacked in the spool: in a ring
    /// batch (its stream summary), or in the range of a loss record in a P1 batch. One
    /// pass over the spool per heartbeat (summaries only; P1 batches are small).
    fn held_from(&self, epoch: u64) -> BTreeMap<u32, u64> {
        let mut low: BTreeMap<u32, u64> = BTreeMap::new();
        let mut note = |sid: u32, seq: u64| {
            let v = low.entry(sid).or_insert(seq);
            *v = (*v).min(seq);
        };
        for b in self.spool.iter() {
            let Ok(view) = BatchView::parse_own(&b.bytes) else { continue };
            if view.header.epoch.get() != epoch {
                continue;
            }
            if b.lane == Class::P1 {
                for f in view.frames() {
                    match f {
                        Ok(Frame::LossRecord(r)) => note(r.stream_id.get(), r.first_seq.get()),
                        Ok(_) => {}
                        Err(_) => break,
                    }
                }
            } else {
                for e in view.summary.iter() {
                    note(e.stream_id.get(), e.first_seq.get());
                }
            }
        }
        low
    }

    /// A lane with batches in flight and no ack for `lane_stall_ns` is sent again. Runs on
    /// every timeout and every heartbeat: a finished source's shipper only heartbeats
    /// (CI under a CPU hog saw a bulk batch whose stream the aggregator stopped wait,
    /// unacked and never resent, through the whole settle phase).
    fn check_stalls(&mut self, now: u64) {
        for lane in 0..4 {
            if self.spool.in_flight(lane) == 0 {
                self.lane_progress_ns[lane] = now;
            } else if now.saturating_sub(self.lane_progress_ns[lane]) >= self.config.lane_stall_ns {
                self.resend_lane(lane, now);
            }
        }
    }

    /// [`Self::check_stalls`] alone, for the SIGTERM flush (no cuts, no heartbeats: the
    /// reader has stopped and the last heartbeat is spooled). Whether a lane was resent.
    pub fn resend_stalled(&mut self, now: u64) -> bool {
        let before = self.stats.lane_resends;
        self.check_stalls(now);
        self.stats.lane_resends != before
    }

    fn resend_lane(&mut self, lane: usize, now: u64) {
        self.spool.resend_lane(lane);
        self.stats.lane_resends += 1;
        if let Some(n) = self.stats.lane_resends_by_lane.get_mut(lane) {
            *n += 1;
        }
        if let Some(p) = self.lane_progress_ns.get_mut(lane) {
            *p = now;
        }
    }

    /// The stream that carried batch `batch_seq` failed or the aggregator stopped it (it
    /// gave up reading a stream that stalled): the batch is still held unacked, so it —
    /// only it: a congested link must not get every unacked batch again — is its lane's
    /// next to send, instead of waiting for the lane to stall (on a busy lane, other
    /// batches' acks would hide the stall for as long as the lane stays busy).
    pub fn handle_send_failed(&mut self, batch_seq: u64) {
        if self.spool.requeue_sent(batch_seq).is_some() {
            self.stats.send_failures += 1;
        }
    }

    fn heartbeat(&mut self, node_mono_ns: u64, now: u64) {
        self.node_mono_ns = self.node_mono_ns.max(node_mono_ns);
        self.check_stalls(now);
        // Everything read so far goes into batches first, and every merged loss range
        // into a record, so held_from is exact.
        let cut = self.batcher.flush();
        self.cut.extend(cut);
        self.settle_losses(now);
        let held = self.held_from(self.batcher.meta().epoch);
        let streams: Vec<StreamEntry> = self
            .counters
            .streams
            .iter()
            .map(|e| {
                let mut e = *e;
                let attempted = e.attempted_seq.get();
                let from = held.get(&e.stream_id.get()).map_or(attempted, |&h| h.min(attempted));
                e.held_from_seq = U64::new(from);
                e
            })
            .collect();
        let state = ShipperStateEntry {
            spool_bytes: U64::new(self.spool.used_bytes() as u64),
            spool_cap_bytes: U64::new(self.config.spool.cap_bytes as u64),
            psi_some_avg10_ppm: U32::new(self.pressure.some_avg10_ppm),
            psi_full_avg10_ppm: U32::new(self.pressure.full_avg10_ppm),
            shed_tier: self.pressure.shed_tier(),
            sampling_level: self.sampling_level,
            _reserved0: [0; 6],
        };
        let seq = self.next_p1_seq();
        let mut w = SectionedFrameWriter::heartbeat(self.shipper_stream, seq, node_mono_ns, self.counters.mono_ns);
        w.section(&streams).section(&self.counters.progress).section(&[state]);
        if !self.counters.owners.is_empty() {
            w.section(&self.counters.owners);
        }
        if !self.counters.interfaces.is_empty() {
            w.section(&self.counters.interfaces);
        }
        let frame = w.finish();
        self.push_into_lane(&frame, now);
        let cut = self.batcher.flush();
        self.cut.extend(cut);
        self.offer_cut(now);
        self.stats.heartbeats += 1;
        // P1 coalesced under `full` pressure: a heartbeat every two intervals, carrying
        // both intervals' running totals (loss records merge while unsent anyway). Never
        // more: liveness and watermarks wait on heartbeats.
        let coalesce = self.pressure.level == Level::Full;
        if coalesce {
            self.stats.heartbeats_coalesced += 1;
        }
        self.next_heartbeat_ns = now + self.config.heartbeat_interval_ns * if coalesce { 2 } else { 1 };
    }

    /// Offers every cut batch; what the spool drops becomes loss records (which may cut
    /// more P1 batches, offered in turn).
    fn offer_cut(&mut self, now: u64) {
        loop {
            // Cut order is batch_seq order; offer oldest first.
            for mut b in std::mem::take(&mut self.cut) {
                b.stages.cut_ns = now.max(1);
                self.stats.batches_cut += 1;
                self.log(BatchEvent::Created { batch_seq: b.batch_seq, lane: b.lane.code(), frames: b.frames });
                let adm = self.spool.offer(b);
                for dropped in adm.dropped {
                    self.lose(dropped, LossCause::ShipperSpoolFull, 0, now);
                }
                for shed in adm.shed {
                    self.lose(shed, LossCause::PsiShed, 0, now);
                }
                for released in adm.released {
                    self.stats.released_undurable += 1;
                    self.log(BatchEvent::Durable { batch_seq: released.batch_seq, aggregator_instance: 0 });
                    self.note_released(&released.bytes);
                    self.batcher.recycle(released.bytes);
                }
            }
            // Loss records wait in the open P1 lane; cut it now so they go out promptly.
            if std::mem::take(&mut self.pending_loss_records)
                && let Some(b) = self.batcher.flush_lane(Class::P1)
            {
                self.cut.push(b);
            }
            if self.cut.is_empty() {
                break;
            }
        }
    }

    fn loss_record(&mut self, r: &LostRange, now: u64) {
        let seq = self.next_p1_seq();
        let f = r.to_frame(self.shipper_stream, seq, r.last_ts);
        self.push_into_lane(f.as_bytes(), now);
        self.stats.loss_records += 1;
        self.pending_loss_records = true;
    }

    /// A batch that will not be delivered: one loss record per stream it held. The
    /// shipper's own P1 frames are not turned into loss records about themselves (that
    /// could loop); they are counted in the running totals every envelope carries.
    fn lose(&mut self, b: Batch, cause: LossCause, reason: u16, now: u64) {
        self.log(BatchEvent::Lost { batch_seq: b.batch_seq, cause: cause.code() });
        self.stats.frames_lost_by_lane[usize::from(b.lane.code()).min(3)] += u64::from(b.frames);
        let slot = cause.drop_slot().unwrap_or(0);
        self.batcher.note_loss(cause, u64::from(b.frames));
        if b.lane == Class::P1 {
            self.stats.own_frames_lost += u64::from(b.frames);
        } else {
            self.stats.frames_lost[slot] += u64::from(b.frames);
            if b.ever_sent {
                self.stats.frames_lost_after_send[slot] += u64::from(b.frames);
            }
            match lost_ranges(&b.bytes, cause, reason) {
                Ok(ranges) => {
                    for r in &ranges {
                        let never_applied =
                            !b.ever_sent && matches!(cause, LossCause::ShipperSpoolFull | LossCause::PsiShed);
                        if !never_applied {
                            self.loss_record(r, now);
                        } else {
                            self.coalesce(r, now);
                        }
                    }
                }
                // Only if the spool's own bytes were corrupted; counted, never silent.
                Err(_) => self.stats.loss_record_errors += 1,
            }
        }
        self.batcher.recycle(b.bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proto_flat::batch::BatchView;
    use proto_flat::codes::AckStatus;
    use proto_flat::decode::Frame;
    use proto_flat::sample;
    use proto_flat::sections::Section;

    const MS: u64 = 1_000_000;

    fn bulk(cpu: u16, seq: u64) -> Vec<u8> {
        sample::bulk_packet(StreamId::new(Class::P2, 1, cpu), seq, seq).as_bytes().to_vec()
    }

    fn core(spool_cap: usize) -> ShipperCore {
        let config = CoreConfig {
            batcher: BatcherConfig {
                max_batch_bytes: 48 * 10,
                bulk_batch_bytes: 48 * 10,
                flush_interval_ns: 5 * MS,
                pool_size: 4,
                pool_bytes: usize::MAX,
            },
            spool: SpoolConfig { cap_bytes: spool_cap, p0_reserve_bytes: 1000, p1_reserve_bytes: 4000 },
            heartbeat_interval_ns: 1000 * MS,
            bulk_window_bytes: 1 << 20,
            batch_log: true,
            lane_stall_ns: 5_000 * MS,
        };
        ShipperCore::new(config, SessionMeta { node_id: 5, epoch: 1, shipper_session: 2 }, 0)
    }

    /// Sends everything and returns the sent batches' bytes.
    fn transmit(c: &mut ShipperCore) -> Vec<Vec<u8>> {
        std::iter::from_fn(|| c.poll_transmit(0).map(|(_, _, b)| b.to_vec())).collect()
    }

    fn frames_of<'a>(batches: &'a [Vec<u8>]) -> impl Iterator<Item = Frame<'a>> {
        batches.iter().flat_map(|b| BatchView::parse(b).unwrap().frames().map(Result::unwrap))
    }

    #[test]
    fn every_frame_is_acked_or_named_in_a_loss_record() {
        // A spool with room for ~4 bulk batches beyond the reserves.
        let mut c = core(5000 + 4 * 700);
        for seq in 0..200 {
            c.handle_frame(&bulk(0, seq), seq * MS / 10);
        }
        c.flush(100 * MS);
        let sent = transmit(&mut c);
        let delivered: Vec<u64> = frames_of(&sent)
            .filter(|f| f.header().stream().class_code() == Class::P2.code())
            .map(|f| f.header().seq.get())
            .collect();
        let mut lost = 0;
        let mut records = 0;
        for f in frames_of(&sent) {
            if let Frame::LossRecord(r) = f {
                assert_eq!(r.cause(), LossCause::ShipperSpoolFull);
                lost += r.count.get();
                records += 1;
                // Never sent: merged, naming no batch.
                assert!(r.batch_seq.get() == 0 && r.shipper_session.get() == 2);
            }
        }
        assert!(lost > 0, "the spool overflowed");
        assert_eq!(records, 1, "contiguous evictions of one stream merge into one record");
        assert_eq!(delivered.len() as u64 + lost, 200, "delivered + named lost = handed in");
        let s = *c.stats();
        assert_eq!(s.frames_lost[LossCause::ShipperSpoolFull.drop_slot().unwrap()], lost);
        assert_eq!(s.frames_lost_after_send, [0; proto_flat::codes::DROP_SLOTS], "none was sent");
        // The running totals in the last envelope carry the loss too.
        let last = sent.iter().map(|b| BatchView::parse(b).unwrap()).max_by_key(|v| v.header.batch_seq.get()).unwrap();
        assert_eq!(last.totals().lost[LossCause::ShipperSpoolFull.drop_slot().unwrap()], lost);
        // Ack everything: the spool empties, the stats add up.
        c.handle_ack(&[(1, u64::MAX)], AckStatus::Applied, 0);
        assert!(c.spool().is_empty());
        assert_eq!(c.stats().frames_acked, delivered.len() as u64 + c.stats().loss_records);
    }

    #[test]
    fn heartbeats_carry_the_owners_the_reader_found_and_none_when_it_found_none() {
        let owner = crate::core::owner::Owner { slurm_job_id: Some(4242), ..Default::default() };
        let owners_in = |c: &mut ShipperCore| -> Vec<(u32, u64)> {
            let sent = transmit(c);
            let mut out = Vec::new();
            for f in frames_of(&sent) {
                if let Frame::Heartbeat(h) = f {
                    for sec in h.sections() {
                        if let Section::Owner(es) = sec {
                            out.extend(es.iter().map(|e| (e.pid.get(), e.slurm_job_id.get())));
                        }
                    }
                }
            }
            out
        };
        let mut c = core(1 << 20);
        let counters = SourceCounters { epoch: 1, owners: vec![owner.entry(42)], ..SourceCounters::default() };
        c.handle_counters(&counters, 0, MS);
        c.handle_timeout(0, 2_000 * MS);
        let seen = owners_in(&mut c);
        assert!(!seen.is_empty() && seen.iter().all(|&o| o == (42, 4242)), "{seen:?}");
        c.handle_counters(&SourceCounters { epoch: 1, ..SourceCounters::default() }, 0, 2_001 * MS);
        c.handle_timeout(0, 4_000 * MS);
        assert!(owners_in(&mut c).is_empty(), "no section when no owner is known");
    }

    #[test]
    fn p3_shedding_frees_pooled_buffers_stops_pooling_and_the_batch_log_until_pressure_eases() {
        let mut c = core(1 << 20);
        let round = |c: &mut ShipperCore, from: u64, now: u64| {
            for seq in from..from + 50 {
                c.handle_frame(&bulk(0, seq), now);
            }
            c.flush(now);
            let _ = transmit(c);
            c.handle_ack(&[(1, u64::MAX)], AckStatus::Applied, now);
        };
        round(&mut c, 0, MS);
        assert!(!c.batch_log().0.is_empty());
        let freed = c.shed_p3();
        assert!(freed > 0, "the pool was freed: {freed}");
        assert!(c.batch_log().0.is_empty(), "the batch log stopped");
        round(&mut c, 50, 2 * MS);
        assert_eq!(c.shed_p3(), 0, "acked buffers were freed, not pooled, while pressured");
        c.restore_p3();
        round(&mut c, 100, 3 * MS);
        assert!(c.shed_p3() > 0, "pooling again once pressure eased");
        assert!(c.batch_log().0.is_empty(), "the batch log stays off");
        assert_eq!(c.stats().frames_in, 150);
    }

    #[test]
    fn memory_pressure_sheds_bulk_as_psi_shed_loss_records_and_heartbeats_say_so() {
        let mut c = core(1 << 20);
        for seq in 0..100 {
            c.handle_frame(&bulk(0, seq), seq * MS / 10);
        }
        c.flush(20 * MS); // bulk batches of at most 480 bytes, none sent
        let p = Pressure { level: Level::Some, some_avg10_ppm: 125_000, full_avg10_ppm: 0 };
        c.set_pressure(p, Some(2 * 480), 21 * MS);
        // Held: the newest batches that fit 960 bytes; the others shed at once.
        for seq in 100..120 {
            c.handle_frame(&bulk(0, seq), 30 * MS);
        }
        c.flush(40 * MS); // more: each evicts older ones
        c.handle_timeout(0, 2_000 * MS); // a heartbeat: merged ranges become records
        let sent = transmit(&mut c);
        let mut delivered = 0;
        let (mut shed, mut records, mut tier) = (0, 0, None);
        for f in frames_of(&sent) {
            match f {
                Frame::LossRecord(r) => {
                    assert_eq!(r.cause(), LossCause::PsiShed);
                    shed += r.count.get();
                    records += 1;
                }
                Frame::Heartbeat(h) => {
                    for sec in h.sections() {
                        if let Section::ShipperState(st) = sec {
                            let st = st.iter().next().unwrap();
                            tier = Some((st.shed_tier, st.psi_some_avg10_ppm.get()));
                        }
                    }
                }
                f if f.header().stream().class_code() == Class::P2.code() => delivered += 1,
                _ => {}
            }
        }
        // At most two batches' bytes of bulk held (the newest), everything else shed.
        assert_eq!(delivered + shed, 120, "delivered + shed = handed in");
        assert!(shed >= 100 && (1..=20).contains(&delivered), "kept {delivered}, shed {shed}");
        assert_eq!(records, 1, "contiguous never-sent batches of one stream: one record");
        assert_eq!(c.stats().frames_lost[LossCause::PsiShed.drop_slot().unwrap()], shed);
        assert_eq!(c.stats().frames_lost_after_send[LossCause::PsiShed.drop_slot().unwrap()], 0, "none was sent");
        let shed_batches = c.spool().counters().shed_pressure;
        assert!(shed_batches >= 10, "{shed_batches}");
        assert_eq!(c.spool().counters().evicted, 0, "not spool-full evictions");
        assert_eq!(tier, Some((2, 125_000)), "the heartbeat carries the pressure");
        // Lifted: nothing more is shed.
        c.set_pressure(Pressure::default(), None, 3_000 * MS);
        for seq in 120..200 {
            c.handle_frame(&bulk(0, seq), 3_000 * MS);
        }
        c.flush(3_010 * MS);
        assert_eq!(c.spool().counters().shed_pressure, shed_batches);
    }

    #[test]
    fn under_full_pressure_heartbeats_come_every_two_intervals_and_back_to_one_after() {
        let mut c = core(1 << 20);
        let full = Pressure { level: Level::Full, some_avg10_ppm: 500_000, full_avg10_ppm: 400_000 };
        c.handle_timeout(0, 1_000 * MS);
        assert_eq!(c.next_heartbeat_ns(), 2_000 * MS);
        c.set_pressure(full, Some(0), 1_500 * MS);
        c.handle_timeout(0, 2_000 * MS);
        assert_eq!(c.next_heartbeat_ns(), 4_000 * MS, "coalesced: one heartbeat for two intervals");
        c.set_pressure(Pressure { level: Level::Some, ..full }, Some(0), 3_000 * MS);
        c.handle_timeout(0, 4_000 * MS);
        assert_eq!(c.next_heartbeat_ns(), 5_000 * MS, "`some` never coalesces P1");
        assert_eq!((c.stats().heartbeats, c.stats().heartbeats_coalesced), (3, 1));
    }

    #[test]
    fn staged_batches_are_sealed_in_order_and_shed_ones_become_merged_loss_records() {
        use crate::core::batcher::Stager;
        let mut c = core(1 << 20);
        let meta = SessionMeta { node_id: 5, epoch: 1, shipper_session: 2 };
        let mut stager = Stager::new(c.config.batcher, meta);
        let mut staged = Vec::new();
        for seq in 0..100 {
            for cpu in 0..2 {
                stager.push(&bulk(cpu, seq), seq, &mut |s| staged.push(s));
            }
        }
        stager.flush(&mut |s| staged.push(s));
        assert_eq!(staged.len(), 20, "10 frames per batch");
        // The reader sheds batches 3..=7 (its queue was full), hands the rest on.
        let mut shed = Vec::new();
        for (i, mut s) in staged.into_iter().enumerate() {
            if (3..=7).contains(&i) {
                shed.extend(s.lost_ranges(LossCause::ShipperSpoolFull, 2));
            } else {
                c.handle_staged(&mut s, 0);
                assert_eq!(s.writer.payload_len(), 0, "the writer goes back emptied");
            }
        }
        c.handle_shed(Class::P2, &shed, 0);
        c.flush(MS);
        let sent = transmit(&mut c);
        let seqs: Vec<u64> = sent
            .iter()
            .map(|b| BatchView::parse(b).unwrap())
            .filter(|v| v.lane() == Class::P2)
            .map(|v| v.header.batch_seq.get())
            .collect();
        assert_eq!(seqs, (1..=15).collect::<Vec<_>>(), "numbered in the order they reached the core");
        let records: Vec<_> =
            frames_of(&sent).filter_map(|f| if let Frame::LossRecord(r) = f { Some(*r) } else { None }).collect();
        // Five shed batches of both streams: one merged record per stream.
        assert_eq!(records.len(), 2, "{records:?}");
        for r in &records {
            assert_eq!((r.first_seq.get(), r.last_seq.get(), r.count.get()), (15, 39, 25));
            assert_eq!((r.cause(), r.batch_seq.get()), (LossCause::ShipperSpoolFull, 0));
        }
        let st = c.stats();
        assert_eq!(st.frames_in, 200);
        assert_eq!((st.frames_shed, st.frames_lost_by_lane[2]), (50, 50));
        c.handle_ack(&[(1, u64::MAX)], AckStatus::Applied, 0);
        let st = c.stats();
        assert_eq!(st.frames_in_by_lane[2], st.frames_acked_by_lane[2] + st.frames_lost_by_lane[2]);
    }

    #[test]
    fn a_nacked_batch_becomes_rejected_loss_records_and_never_loops() {
        let mut c = core(1 << 20);
        for seq in 0..10 {
            c.handle_frame(&bulk(3, seq), 0);
        }
        c.flush(MS);
        let (_, poisoned, _) = c.poll_transmit(0).unwrap();
        c.handle_nack(poisoned, NackReason::SummaryMismatch, 2 * MS);
        let sent = transmit(&mut c);
        let records: Vec<_> =
            frames_of(&sent).filter_map(|f| if let Frame::LossRecord(r) = f { Some(*r) } else { None }).collect();
        assert_eq!(records.len(), 1);
        assert_eq!(records[0].cause(), LossCause::Rejected);
        assert_eq!(records[0].reason.get(), NackReason::SummaryMismatch.code());
        assert_eq!((records[0].first_seq.get(), records[0].last_seq.get(), records[0].count.get()), (0, 9, 10));
        c.reconnected();
        let again = transmit(&mut c);
        assert!(
            again.iter().all(|b| BatchView::parse(b).unwrap().header.batch_seq.get() != poisoned),
            "the nacked batch is gone"
        );
        assert_eq!(c.stats().batches_nacked, 1);
    }

    /// A core that sent one bulk batch (ten frames, flushed at 1 ms), and that batch.
    fn one_bulk_batch_sent() -> (ShipperCore, Vec<Vec<u8>>) {
        let mut c = core(1 << 20);
        for seq in 0..10 {
            c.handle_frame(&bulk(2, seq), 0);
        }
        c.flush(MS);
        let first = transmit(&mut c);
        assert_eq!(first.len(), 1);
        (c, first)
    }

    #[test]
    fn a_stopped_stream_or_a_stalled_lane_sends_its_batches_again_also_when_only_heartbeating() {
        // Regression (CI under a CPU hog): the aggregator stopped a bulk stream it could
        // not read in time; the source had finished, so the shipper only heartbeated and
        // never ran its stall check: the batch waited unacked through the settle phase.
        let (mut c, first) = one_bulk_batch_sent();
        let seq = BatchView::parse(&first[0]).unwrap().header.batch_seq.get();
        // A failed stream: that batch is sent again at once.
        c.handle_send_failed(seq);
        assert_eq!(transmit(&mut c), first, "the same batch again");
        assert_eq!((c.stats().send_failures, c.stats().lane_resends), (1, 0));
        // An unknown or already acked batch_seq changes nothing.
        c.handle_send_failed(seq + 100);
        assert!(transmit(&mut c).is_empty());
        // No ack for the stall time: a heartbeat alone (no timeout call) sends it again.
        let counters = SourceCounters::default();
        c.handle_counters(&counters, 10 * MS, 2 * MS + 5_000 * MS);
        let again: Vec<Vec<u8>> = transmit(&mut c)
            .into_iter()
            .filter(|b| BatchView::parse(b).unwrap().header.lane == Class::P2.code())
            .collect();
        assert_eq!(again, first);
        assert_eq!(c.stats().lane_resends, 1);
        c.handle_ack(&[(1, u64::MAX)], AckStatus::Applied, 5_010 * MS);
        c.handle_counters(&counters, 20 * MS, 20_000 * MS);
        assert!(transmit(&mut c).iter().all(|b| BatchView::parse(b).unwrap().header.lane != Class::P2.code()));
        assert_eq!(c.stats().lane_resends, 1, "acked: nothing more");
    }

    #[test]
    fn the_sigterm_flush_resends_a_stalled_lane_without_heartbeats_or_cuts() {
        // Regression (the 64 MiB memcg test): the pump had stopped for the flush, nothing
        // ran the stall check, and a P0 batch waited unacked until the deadline gave it up.
        let (mut c, first) = one_bulk_batch_sent();
        assert!(!c.resend_stalled(2_000 * MS), "not stalled yet");
        assert!(transmit(&mut c).is_empty());
        assert!(c.resend_stalled(MS + 5_000 * MS), "no ack for the stall time");
        assert_eq!(transmit(&mut c), first, "the same batch again, and nothing else (no heartbeat)");
        assert_eq!(c.stats().lane_resends_by_lane[Class::P2.code() as usize], 1);
        c.handle_ack(&[(1, u64::MAX)], AckStatus::Applied, 5_010 * MS);
        assert!(!c.resend_stalled(60_000 * MS), "acked: nothing in flight");
        assert!(c.spool().is_empty());
    }

    #[test]
    fn heartbeats_carry_counters_held_from_and_state_also_when_idle() {
        let mut c = core(1 << 20);
        for seq in 0..3 {
            c.handle_frame(&bulk(1, seq), 0);
        }
        let mut e = StreamEntry::new_zeroed();
        e.stream_id = U32::new(StreamId::new(Class::P2, 1, 1).0);
        e.attempted_seq = U64::new(3);
        e.sampled_out = U64::new(7);
        let counters = SourceCounters { epoch: 1, mono_ns: 900, streams: vec![e], ..SourceCounters::default() };
        c.handle_counters(&counters, 1_000, MS);
        let sent = transmit(&mut c);
        let hb: Vec<_> =
            frames_of(&sent).filter_map(|f| if let Frame::Heartbeat(h) = f { Some(h) } else { None }).collect();
        assert_eq!(hb.len(), 1);
        assert_eq!(hb[0].head.snapshot_ns.get(), 900);
        let mut saw = (false, false);
        for s in hb[0].sections() {
            match s {
                Section::Streams(es) => {
                    let e = es.iter().next().unwrap();
                    assert_eq!(e.held_from_seq.get(), 0, "frames 0..=2 are still held unacked");
                    saw.0 = true;
                }
                Section::ShipperState(st) => {
                    assert_eq!(st.iter().next().unwrap().spool_cap_bytes.get(), 1 << 20);
                    saw.1 = true;
                }
                _ => {}
            }
        }
        assert_eq!(saw, (true, true));
        // The bulk frames went out before (or with) the heartbeat: flushed first.
        assert_eq!(frames_of(&sent).filter(|f| f.header().stream().class_code() == 2).count(), 3);
        assert_eq!(c.batcher().totals().sampled_out, 7);
        // Idle: the next heartbeat still comes, at the interval; with everything acked it
        // says nothing is held any more (held_from = attempted).
        c.handle_ack(&[(1, u64::MAX)], AckStatus::Applied, 2 * MS);
        assert_eq!(c.poll_timeout(), 1001 * MS);
        c.handle_timeout(2_000, 1001 * MS);
        assert_eq!(c.stats().heartbeats, 2);
        let held: Vec<u64> = frames_of(&transmit(&mut c))
            .filter_map(|f| if let Frame::Heartbeat(h) = f { Some(h) } else { None })
            .flat_map(|h| {
                h.sections()
                    .filter_map(|s| {
                        if let Section::Streams(es) = s { Some(es.iter().next()?.held_from_seq.get()) } else { None }
                    })
                    .collect::<Vec<_>>()
            })
            .collect();
        assert_eq!(held, vec![3]);
    }

    /// Regression (issue 16, `mixed` beside a CPU hog): a heartbeat between a new epoch's
    /// start and its first counters carried the old epoch's stream counts under the new
    /// epoch; the aggregator kept them (counters only grow) and waited for them forever.
    #[test]
    fn a_heartbeat_after_an_epoch_change_carries_no_counters_of_the_old_epoch_regression_issue_16() {
        let mut c = core(1 << 20);
        let mut e = StreamEntry::new_zeroed();
        e.stream_id = U32::new(StreamId::new(Class::P2, 1, 1).0);
        e.attempted_seq = U64::new(2300);
        let counters = SourceCounters { epoch: 1, mono_ns: 900, streams: vec![e], ..SourceCounters::default() };
        c.handle_counters(&counters, 1_000, MS);
        c.handle_epoch(&EpochStart { epoch: 2, mono_ns: 1_500, ..EpochStart::default() }, 2 * MS);
        c.heartbeat_now(2_000, 3 * MS);
        let sent = transmit(&mut c);
        let last = frames_of(&sent).filter_map(|f| if let Frame::Heartbeat(h) = f { Some(h) } else { None }).last();
        let streams: Vec<u64> = last
            .expect("a heartbeat")
            .sections()
            .filter_map(|s| {
                if let Section::Streams(es) = s {
                    Some(es.iter().map(|e| e.attempted_seq.get()).collect::<Vec<_>>())
                } else {
                    None
                }
            })
            .flatten()
            .collect();
        assert!(streams.is_empty(), "epoch 2's heartbeat carried epoch 1's counts {streams:?}");
        assert_eq!((c.counters().epoch, c.counters().mono_ns), (2, 1_500));
    }

    /// Issue 16: what a `resume` says — the held batches as ranges, and per stream one
    /// past the highest seq that left the spool acked (frames, or a loss record's range).
    #[test]
    fn resume_names_held_batches_and_the_floor_of_every_acked_stream() {
        let mut c = core(5000 + 4 * 700);
        for seq in 0..30 {
            c.handle_frame(&bulk(0, seq), 0);
        }
        c.flush(MS);
        let sent = transmit(&mut c);
        let seqs: Vec<u64> = sent.iter().map(|b| BatchView::parse(b).unwrap().header.batch_seq.get()).collect();
        assert_eq!(seqs, vec![1, 2, 3], "three bulk batches of 10 frames");
        // Batch 2 acked first (acks arrive out of order): the floor is past its frames.
        c.handle_ack(&[(2, 2)], AckStatus::Applied, MS);
        let r = c.resume();
        assert_eq!((r.shipper_session, r.epoch, r.next_batch_seq), (2, 1, 4));
        assert_eq!(r.held, vec![(1, 1), (3, 3)]);
        assert_eq!(r.floors, vec![(StreamId::new(Class::P2, 1, 0).0, 20)]);
        // A loss record acked in a P1 batch moves its stream's floor too, and the
        // shipper's own stream moves with its acked P1 frames.
        c.handle_nack(3, NackReason::SummaryMismatch, 2 * MS);
        let p1 = transmit(&mut c);
        let p1_seq = BatchView::parse(&p1[0]).unwrap().header.batch_seq.get();
        c.handle_ack(&[(p1_seq, p1_seq)], AckStatus::Applied, 3 * MS);
        let r = c.resume();
        assert_eq!(r.held, vec![(1, 1)]);
        assert_eq!(r.next_batch_seq, p1_seq + 1);
        assert!(r.floors.contains(&(StreamId::new(Class::P2, 1, 0).0, 30)), "{:?}", r.floors);
        assert!(r.floors.contains(&(SHIPPER_STREAM.0, 1)), "{:?}", r.floors);
        // A new epoch: the old epoch's floors are gone.
        c.handle_epoch(&EpochStart { epoch: 2, ..EpochStart::default() }, 4 * MS);
        assert!(c.resume().floors.is_empty());
    }

    /// Issue 16: at shutdown what could not be flushed leaves as `shipper_shutdown` loss
    /// records (never silently), and the per-lane identity holds.
    #[test]
    fn give_up_data_names_every_unflushed_frame_in_shutdown_loss_records() {
        let mut c = core(1 << 20);
        for seq in 0..25 {
            c.handle_frame(&bulk(0, seq), 0);
        }
        c.flush(MS);
        let _ = transmit(&mut c);
        c.handle_ack(&[(1, 1)], AckStatus::Applied, 2 * MS);
        assert_eq!(c.give_up_data(3 * MS), 15);
        let records = transmit(&mut c);
        let lost: Vec<_> =
            frames_of(&records).filter_map(|f| if let Frame::LossRecord(r) = f { Some(*r) } else { None }).collect();
        assert!(lost.iter().all(|r| r.cause() == LossCause::ShipperShutdown));
        assert_eq!(lost.iter().map(|r| r.count.get()).sum::<u64>(), 15);
        // The loss records' P1 batch acked: per lane, in = acked + lost.
        let p1: Vec<u64> = records.iter().map(|b| BatchView::parse(b).unwrap().header.batch_seq.get()).collect();
        for seq in p1 {
            c.handle_ack(&[(seq, seq)], AckStatus::Applied, 4 * MS);
        }
        let s = c.stats();
        for lane in 0..4 {
            assert_eq!(s.frames_in_by_lane[lane], s.frames_acked_by_lane[lane] + s.frames_lost_by_lane[lane], "{lane}");
        }
        assert_eq!(s.frames_lost[LossCause::ShipperShutdown.drop_slot().unwrap()], 15);
        assert_eq!(s.frames_lost_after_send[LossCause::ShipperShutdown.drop_slot().unwrap()], 15, "all were sent");
        assert!(c.spool().is_empty());
    }

    #[test]
    fn a_delivered_batch_records_each_stage_it_passed() {
        let mut c = core(1 << 20);
        for seq in 0..10 {
            c.handle_frame(&bulk(0, seq), MS);
        }
        c.flush(6 * MS);
        let sent: Vec<u64> = std::iter::from_fn(|| c.poll_transmit(8 * MS).map(|(_, s, _)| s)).collect();
        assert_eq!(sent.len(), 1);
        c.handle_ack(&[(sent[0], sent[0])], AckStatus::Applied, 11 * MS);
        let l = c.latency();
        let only = |h: &hdrhistogram::Histogram<u64>| (h.len(), h.max() / 100 * 100);
        assert_eq!(only(&l.stages[0]), (0, 0), "no read stage: the frames came through the core, not the reader");
        assert_eq!(only(&l.stages[1]), (1, 5_000), "batch: first frame 1 ms → sealed 6 ms");
        assert_eq!(only(&l.stages[2]), (1, 2_000), "send: → 8 ms");
        assert_eq!(only(&l.stages[3]), (1, 3_000), "ack: → 11 ms");
        assert_eq!(only(&l.lanes[2]), (1, 10_000), "delivery: first frame → ack");
    }

    #[test]
    fn bulk_shed_in_flight_is_counted_apart_and_its_records_name_the_batch() {
        let mut c = core(1 << 20);
        for seq in 0..30 {
            c.handle_frame(&bulk(0, seq), 0);
        }
        c.flush(MS);
        let sent = transmit(&mut c);
        assert!(!sent.is_empty());
        let full = Pressure { level: Level::Full, some_avg10_ppm: 500_000, full_avg10_ppm: 400_000 };
        c.set_pressure(full, Some(0), 2 * MS);
        let slot = LossCause::PsiShed.drop_slot().unwrap();
        assert_eq!(c.stats().frames_lost[slot], 30, "every held bulk frame shed");
        assert_eq!(c.stats().frames_lost_after_send[slot], 30, "all of them after their batch was sent");
        let records = transmit(&mut c);
        let lost: Vec<_> =
            frames_of(&records).filter_map(|f| if let Frame::LossRecord(r) = f { Some(*r) } else { None }).collect();
        assert_eq!(lost.iter().map(|r| r.count.get()).sum::<u64>(), 30);
        // Sent batches may have been applied: each record names its batch, so the
        // aggregator can ignore one for a batch it has.
        assert!(lost.iter().all(|r| r.cause() == LossCause::PsiShed && r.batch_seq.get() != 0), "{lost:?}");
    }

    #[test]
    fn abandon_reports_what_was_never_acked() {
        let mut c = core(1 << 20);
        for seq in 0..25 {
            c.handle_frame(&bulk(0, seq), 0);
        }
        c.flush(MS);
        let _ = transmit(&mut c);
        c.handle_ack(&[(1, 1)], AckStatus::Applied, 0);
        let u = c.abandon();
        assert_eq!((u.batches, u.frames), (2, 15));
        assert_eq!(u.frames_by_lane[2], 15);
        assert_eq!(c.stats().frames_acked + u.frames, 25);
        assert!(c.spool().is_empty());
    }

    #[test]
    fn the_batch_log_gives_every_created_batch_a_fate() {
        let mut c = core(1 << 20);
        c.reconnected();
        c.handle_hello(7, 1, 3, Durability::None);
        for seq in 0..30 {
            c.handle_frame(&bulk(0, seq), 0);
        }
        c.flush(MS);
        let _ = transmit(&mut c);
        c.handle_ack(&[(1, 1)], AckStatus::Applied, 2 * MS);
        c.handle_nack(2, NackReason::BadMagic, 2 * MS);
        let _ = c.abandon();
        let (log, overflow) = c.batch_log();
        assert_eq!(overflow, 0);
        let created: Vec<u64> = log
            .iter()
            .filter_map(|e| if let BatchEvent::Created { batch_seq, .. } = e { Some(*batch_seq) } else { None })
            .collect();
        assert_eq!(created.len(), 4, "3 bulk batches and the loss records' P1 batch: {log:?}");
        assert!(log.contains(&BatchEvent::Sent { batch_seq: 1, connection: 1 }));
        assert!(log.contains(&BatchEvent::Acked { batch_seq: 1, aggregator_instance: 7 }));
        assert!(log.contains(&BatchEvent::Nacked { batch_seq: 2, reason: NackReason::BadMagic.code() }));
        assert!(log.contains(&BatchEvent::Lost { batch_seq: 2, cause: LossCause::Rejected.code() }));
        for seq in created {
            let fated = log.iter().any(|e| {
                matches!(e, BatchEvent::Acked { batch_seq, .. } | BatchEvent::Lost { batch_seq, .. } | BatchEvent::Abandoned { batch_seq } if *batch_seq == seq)
            });
            assert!(fated, "batch {seq} has no fate: {log:?}");
        }
    }
}
