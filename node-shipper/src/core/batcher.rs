//! The batcher: frames in (unparsed), batches out, one open batch per lane.
//!
//! Method groups and call order: inputs [`Batcher::push`] (a frame read off a ring) and
//! [`Batcher::recycle`] (a buffer the spool released); outputs [`Batcher::poll_cut`]
//! (batches whose flush interval passed) and [`Batcher::flush`] (everything, at
//! shutdown); getters [`Batcher::totals`], [`Batcher::next_batch_seq`].
//!
//! A batch is cut when the next frame would push it past `max_batch_bytes`, or when it
//! has been open `flush_interval` long. Cut batches carry the session's running totals
//! (shipped, lost by cause, sampled out). Buffers come from a pool the spool refills: in
//! steady state no batch allocates.

use proto_flat::DecodeError;
use proto_flat::batch::{BatchMeta, BatchWriter, RunningTotals};
use proto_flat::codes::{Class, LossCause, WireEnum};
use proto_flat::decode::split_frame;
use zerocopy::FromBytes;

use super::loss::LostRange;

/// Batching limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatcherConfig {
    /// Payload bytes per P0/P1 batch (64 KiB: small, prompt).
    pub max_batch_bytes: usize,
    /// Payload bytes per bulk (P2/P3) batch (256 KiB: fewer streams, acks and
    /// per-batch work per byte; `loadgen bench` measured the transport's cost per byte).
    pub bulk_batch_bytes: usize,
    /// How long a batch may stay open (P0 latency is bounded by this).
    pub flush_interval_ns: u64,
    /// Buffers kept for reuse: at most this many …
    pub pool_size: usize,
    /// … holding at most this many bytes of capacity (each of the core's pool and the
    /// reader's spare writers). What the cap turns away is freed and counted
    /// ([`Batcher::pool_turned_away`], [`Stager::spare_turned_away`]); the memory budget
    /// counts both pools at this cap.
    pub pool_bytes: usize,
}

impl Default for BatcherConfig {
    fn default() -> Self {
        Self {
            max_batch_bytes: 64 * 1024,
            bulk_batch_bytes: 256 * 1024,
            flush_interval_ns: 5_000_000,
            pool_size: 256,
            // Sixteen bulk batches: enough for buffers to cycle at line rate (a batch is
            // acked and its buffer reused long before sixteen more are cut).
            pool_bytes: 4 << 20,
        }
    }
}

impl BatcherConfig {
    /// The payload cap of lane `i` (0–3).
    #[must_use]
    pub fn lane_bytes(&self, i: usize) -> usize {
        if i >= 2 { self.bulk_batch_bytes.max(self.max_batch_bytes) } else { self.max_batch_bytes }
    }
}

/// Who is shipping.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SessionMeta {
    pub node_id: u64,
    pub epoch: u64,
    pub shipper_session: u64,
}

impl SessionMeta {
    /// The envelope identity of a batch begun now in `lane` (numbered when cut).
    #[must_use]
    pub fn batch(&self, lane: u8, clock_mono_ns: u64, clock_realtime_ns: u64) -> BatchMeta {
        BatchMeta {
            node_id: self.node_id,
            epoch: self.epoch,
            shipper_session: self.shipper_session,
            batch_seq: 0,
            lane,
            clock_mono_ns,
            clock_realtime_ns,
        }
    }
}

/// A cut batch: sealed envelope bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    pub lane: Class,
    pub batch_seq: u64,
    pub frames: u32,
    pub bytes: Vec<u8>,
    /// When its first frame arrived (caller's clock): latency is measured from here.
    pub opened_ns: u64,
    /// The stages before and after `opened_ns` (for the stage latency metrics).
    pub stages: StageTimes,
    /// Ever handed out to be sent (on any connection): the aggregator may have applied
    /// it, so a loss report for it names its `batch_seq`.
    pub ever_sent: bool,
}

/// When a batch passed each stage (the core's clock, ns; 0: not yet) and how long its
/// first frame waited in the ring before the reader read it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StageTimes {
    /// Kernel timestamp of the batch's first frame → the start of the drain pass that
    /// read it (ns, at least 1; 0 when unknown: a source whose clock is not the
    /// reader's, or a P0 batch, whose frames carry the collective event's time).
    pub read_ns: u64,
    /// Sealed into the spool's order by the core.
    pub cut_ns: u64,
    /// First handed to the network.
    pub sent_ns: u64,
}

#[derive(Debug, Default)]
struct Lane {
    writer: BatchWriter,
    opened_at: Option<u64>,
    /// The first frame's wait in the ring (the stager's lanes only).
    read_ns: u64,
}

/// The batcher. See the module docs.
#[derive(Debug)]
pub struct Batcher {
    config: BatcherConfig,
    meta: SessionMeta,
    lanes: [Lane; 4],
    next_batch_seq: u64,
    totals: RunningTotals,
    pool: Vec<Vec<u8>>,
    /// Capacity held by `pool`.
    pooled_bytes: usize,
    /// Buffers freed because the pool was at its count or byte cap.
    pool_turned_away: u64,
    /// Whether buffers back from the spool are kept for reuse (off under memory
    /// pressure: they are freed instead).
    pooling: bool,
    clock_mono_ns: u64,
    clock_realtime_ns: u64,
}

fn lane_index(class: u8) -> Option<usize> {
    let i = usize::from(class);
    (i < 4).then_some(i)
}

impl Batcher {
    /// A batcher for one shipper session; `batch_seq` starts at 1.
    #[must_use]
    pub fn new(config: BatcherConfig, meta: SessionMeta) -> Self {
        // Prefilled to half its byte cap: the other half takes buffers back from the
        // spool (bulk ones are four times this size) without turning them away.
        let each = config.max_batch_bytes + 4096;
        let count = config.pool_size.min(config.pool_bytes / 2 / each.max(1));
        let pool: Vec<Vec<u8>> = (0..count).map(|_| Vec::with_capacity(each)).collect();
        let pooled_bytes = pool.iter().map(Vec::capacity).sum();
        Self {
            config,
            meta,
            lanes: Default::default(),
            next_batch_seq: 1,
            totals: RunningTotals::default(),
            pool,
            pooled_bytes,
            pool_turned_away: 0,
            pooling: true,
            clock_mono_ns: 0,
            clock_realtime_ns: 0,
        }
    }

    /// Running totals so far.
    #[must_use]
    pub fn totals(&self) -> &RunningTotals {
        &self.totals
    }

    /// The batch_seq the next cut batch gets.
    #[must_use]
    pub fn next_batch_seq(&self) -> u64 {
        self.next_batch_seq
    }

    /// The session identity stamped on batches begun from now on.
    #[must_use]
    pub fn meta(&self) -> SessionMeta {
        self.meta
    }

    /// A new kernel-counter epoch: open batches (of the old epoch) are cut first and
    /// returned, so no batch mixes epochs.
    pub fn set_epoch(&mut self, epoch: u64) -> Vec<Batch> {
        let cut = self.flush();
        self.meta.epoch = epoch;
        cut
    }

    /// The paired clock read stamped on batches cut from now on.
    pub fn set_clock(&mut self, mono_ns: u64, realtime_ns: u64) {
        self.clock_mono_ns = mono_ns;
        self.clock_realtime_ns = realtime_ns;
    }

    /// Frames lost with `cause` (counted into the running totals every batch carries).
    pub fn note_loss(&mut self, cause: LossCause, frames: u64) {
        if let Some(slot) = cause.drop_slot().and_then(|s| self.totals.lost.get_mut(s)) {
            *slot += frames;
        }
    }

    /// Kernel sampled-out total (cumulative over the session's streams).
    pub fn set_sampled_out(&mut self, total: u64) {
        self.totals.sampled_out = total;
    }

    /// A buffer back from the spool (acked or evicted batch).
    pub fn recycle(&mut self, buf: Vec<u8>) {
        let cap = buf.capacity();
        if self.pooling
            && self.pool.len() < self.config.pool_size
            && self.pooled_bytes.saturating_add(cap) <= self.config.pool_bytes
        {
            self.pooled_bytes += cap;
            self.pool.push(buf);
        } else if self.pooling {
            self.pool_turned_away += 1;
        }
    }

    /// A pooled buffer (or a new empty one).
    fn take_pooled(&mut self) -> Vec<u8> {
        let buf = self.pool.pop().unwrap_or_default();
        self.pooled_bytes = self.pooled_bytes.saturating_sub(buf.capacity());
        buf
    }

    /// Capacity held in the pool now.
    #[must_use]
    pub fn pooled_bytes(&self) -> usize {
        self.pooled_bytes
    }

    /// Buffers freed because the pool was full (by count or bytes) while pooling.
    #[must_use]
    pub fn pool_turned_away(&self) -> u64 {
        self.pool_turned_away
    }

    /// Memory pressure (P3): frees the pooled buffers and stops pooling (`false`), or
    /// pools again (`true`). Returns the bytes of capacity freed.
    pub fn set_pooling(&mut self, on: bool) -> usize {
        self.pooling = on;
        if on {
            return 0;
        }
        let freed = self.pooled_bytes;
        self.pool = Vec::new();
        self.pooled_bytes = 0;
        freed
    }

    /// Adds one frame (exactly one ring record). Returns a batch if the frame's lane had
    /// to be cut first to make room.
    pub fn push(&mut self, frame: &[u8], now: u64) -> Result<Option<Batch>, DecodeError> {
        let (header, _, _) = split_frame(frame, 0)?;
        let class = header.stream().class_code();
        let Some(i) = lane_index(class) else {
            return Err(DecodeError::LaneMismatch { offset: 0, class, lane: 0 });
        };
        let mut cut = None;
        let over = self
            .lanes
            .get(i)
            .is_some_and(|l| l.opened_at.is_some() && l.writer.payload_len() + frame.len() > self.config.lane_bytes(i));
        if over {
            cut = self.cut(i);
        }
        let meta = self.meta.batch(class, self.clock_mono_ns, self.clock_realtime_ns);
        let Some(lane) = self.lanes.get_mut(i) else { return Ok(cut) };
        if lane.opened_at.is_none() {
            lane.writer.begin(&meta);
            lane.opened_at = Some(now);
        }
        lane.writer.push_frame(frame)?;
        Ok(cut)
    }

    /// The next lane whose flush interval has passed, cut.
    pub fn poll_cut(&mut self, now: u64) -> Option<Batch> {
        let due = self
            .lanes
            .iter()
            .position(|l| l.opened_at.is_some_and(|t| now.saturating_sub(t) >= self.config.flush_interval_ns))?;
        self.cut(due)
    }

    /// When the next lane falls due (for the driver's timer).
    #[must_use]
    pub fn poll_timeout(&self) -> Option<u64> {
        self.lanes.iter().filter_map(|l| l.opened_at).min().map(|t| t + self.config.flush_interval_ns)
    }

    /// Cuts every open batch (shutdown, or before a heartbeat so `held_from` is
    /// exact).
    pub fn flush(&mut self) -> Vec<Batch> {
        (0..self.lanes.len()).filter_map(|i| self.cut(i)).collect()
    }

    /// Cuts one lane's open batch, if any.
    pub fn flush_lane(&mut self, class: Class) -> Option<Batch> {
        self.cut(lane_index(class.code())?)
    }

    /// Seals a batch the ring reader staged ([`Stager`]): numbered now (so `batch_seq`
    /// follows the order batches reach the spool, across the reader's lanes and the
    /// core's own), stamped with the running totals, checksummed. The writer is left
    /// empty with a pooled buffer, to go back to the reader.
    pub fn seal(&mut self, staged: &mut Staged) -> Batch {
        let replacement = self.take_pooled();
        let mut b = Self::number_and_seal(
            &mut self.next_batch_seq,
            &mut self.totals,
            &mut staged.writer,
            replacement,
            staged.lane,
            staged.opened_ns,
        );
        b.stages.read_ns = staged.read_ns;
        b
    }

    /// Numbers the writer's batch (`batch_seq` follows cut order across lanes), stamps
    /// the running totals, seals it, and hands its buffer out (the writer keeps
    /// `replacement`).
    fn number_and_seal(
        next_batch_seq: &mut u64,
        totals: &mut RunningTotals,
        writer: &mut BatchWriter,
        replacement: Vec<u8>,
        lane: Class,
        opened_ns: u64,
    ) -> Batch {
        let frames = writer.frame_count();
        let batch_seq = *next_batch_seq;
        *next_batch_seq += 1;
        totals.shipped += u64::from(frames);
        writer.set_batch_seq(batch_seq);
        let bytes = writer.finish_swap(totals, replacement);
        Batch { lane, batch_seq, frames, bytes, opened_ns, stages: StageTimes::default(), ever_sent: false }
    }

    /// Frames shed before they reached a batch (the reader's queue was full) are lost
    /// with `cause`; counted into the running totals like any other loss. Frames put
    /// into a batch and shed with it count as shipped too (they were, as far as the
    /// totals go, handed to the shipper).
    pub fn note_shed(&mut self, frames: u64) {
        self.totals.shipped += frames;
    }

    fn cut(&mut self, i: usize) -> Option<Batch> {
        let opened_ns = self.lanes.get_mut(i)?.opened_at.take()?;
        let replacement = self.take_pooled();
        let lane = self.lanes.get_mut(i)?;
        let class = Class::from_code(u8::try_from(i).unwrap_or(0));
        Some(Self::number_and_seal(
            &mut self.next_batch_seq,
            &mut self.totals,
            &mut lane.writer,
            replacement,
            class,
            opened_ns,
        ))
    }
}

/// A ring-lane batch the reader filled and cut, not yet numbered or sealed: the
/// writer travels to the core, which seals it ([`Batcher::seal`]) and sends the emptied
/// writer back.
#[derive(Debug)]
pub struct Staged {
    pub lane: Class,
    pub writer: BatchWriter,
    /// When its first frame arrived (the reader's clock, the core's clock: one `now`).
    pub opened_ns: u64,
    /// How long that frame had waited in the ring (see [`StageTimes::read_ns`]).
    pub read_ns: u64,
}

impl Staged {
    /// Payload bytes (what the reader's queue counts against its cap).
    #[must_use]
    pub fn payload_len(&self) -> usize {
        self.writer.payload_len()
    }

    /// Frames in it.
    #[must_use]
    pub fn frames(&self) -> u32 {
        self.writer.frame_count()
    }

    /// Its frames as lost ranges, one per stream (a staged batch the reader shed: it
    /// never got a `batch_seq`, so the records name none — 0).
    pub fn lost_ranges(&self, cause: LossCause, shipper_session: u64) -> impl Iterator<Item = LostRange> + '_ {
        self.writer.summary().iter().map(move |e| LostRange::of_summary(e, (shipper_session, 0), cause, 0))
    }
}

/// The ring reader's half of batching: frames copied into one open writer per lane,
/// cut on size or age, handed on unsealed ([`Staged`]). Pure; owned by the reader
/// thread, so the per-frame work takes no lock.
#[derive(Debug)]
pub struct Stager {
    config: BatcherConfig,
    meta: SessionMeta,
    lanes: [Lane; 4],
    /// Emptied writers back from the core.
    spare: Vec<BatchWriter>,
    /// Buffer capacity held by `spare`.
    spare_bytes: usize,
    /// Writers freed because `spare` was at its count or byte cap.
    pub spare_turned_away: u64,
    /// Whether emptied writers are kept (off under memory pressure).
    pooling: bool,
    /// Frames taken, per lane, and frames refused as malformed.
    pub frames_by_lane: [u64; 4],
    pub frames_malformed: u64,
    /// The source's clock (frame timestamps) minus `now`'s, when the source keeps the
    /// node's monotonic clock: how long a frame waited in the ring is then known.
    mono_offset_ns: Option<i128>,
}

impl Stager {
    #[must_use]
    pub fn new(config: BatcherConfig, meta: SessionMeta) -> Self {
        Self {
            config,
            meta,
            lanes: Default::default(),
            spare: Vec::new(),
            spare_bytes: 0,
            spare_turned_away: 0,
            pooling: true,
            frames_by_lane: [0; 4],
            frames_malformed: 0,
            mono_offset_ns: None,
        }
    }

    /// Sets the source's clock minus the reader's (`None`: frame timestamps are in no
    /// clock the reader knows).
    pub fn set_mono_offset(&mut self, offset_ns: Option<i128>) {
        self.mono_offset_ns = offset_ns;
    }

    /// A new kernel-counter epoch: open batches (of the old one) are cut first.
    pub fn set_epoch(&mut self, epoch: u64, out: &mut impl FnMut(Staged)) {
        self.flush(out);
        self.meta.epoch = epoch;
    }

    /// An emptied writer back from the core, for reuse.
    pub fn give_back(&mut self, writer: BatchWriter) {
        let cap = writer.buffer_capacity();
        if self.pooling
            && self.spare.len() < self.config.pool_size
            && self.spare_bytes.saturating_add(cap) <= self.config.pool_bytes
        {
            self.spare_bytes += cap;
            self.spare.push(writer);
        } else if self.pooling {
            self.spare_turned_away += 1;
        }
    }

    /// Buffer capacity held by the spare writers now.
    #[must_use]
    pub fn spare_bytes(&self) -> usize {
        self.spare_bytes
    }

    /// Memory pressure (P3): frees the spare writers and stops keeping them (`false`), or
    /// keeps them again (`true`). Returns how many were freed.
    pub fn set_pooling(&mut self, on: bool) -> usize {
        self.pooling = on;
        if on {
            return 0;
        }
        self.spare_bytes = 0;
        std::mem::take(&mut self.spare).len()
    }

    /// Adds one ring record; a lane that had to be cut first to make room is handed to
    /// `out`. A record whose header or length is wrong is counted and skipped.
    #[inline]
    pub fn push(&mut self, frame: &[u8], now: u64, out: &mut impl FnMut(Staged)) {
        let Some((class, ts)) =
            proto_flat::FrameHeader::ref_from_prefix(frame).ok().map(|(h, _)| (h.stream().class_code(), h.ts_ns.get()))
        else {
            self.frames_malformed += 1;
            return;
        };
        let Some(i) = lane_index(class) else {
            self.frames_malformed += 1;
            return;
        };
        let cap = self.config.lane_bytes(i);
        if self.lanes.get(i).is_some_and(|l| l.opened_at.is_some() && l.writer.payload_len() + frame.len() > cap)
            && let Some(s) = self.cut(i)
        {
            out(s);
        }
        let meta = self.meta.batch(class, 0, 0);
        let offset = self.mono_offset_ns;
        let Some(lane) = self.lanes.get_mut(i) else { return };
        if lane.opened_at.is_none() {
            if let Some(w) = self.spare.pop() {
                self.spare_bytes = self.spare_bytes.saturating_sub(w.buffer_capacity());
                lane.writer = w;
            }
            lane.writer.begin(&meta);
            lane.opened_at = Some(now);
            // Bulk only: a P0 frame carries the collective event's own time (the NCCL
            // profiler's), not when it was written to the ring. At least 1 (0: unknown):
            // `now` is the drain pass's start, so a frame written during the pass reads
            // as having waited nothing.
            lane.read_ns = offset.filter(|_| class >= Class::P2.code()).map_or(0, |o| {
                u64::try_from((i128::from(now) + o - i128::from(ts)).clamp(1, i128::from(u64::MAX))).unwrap_or(1)
            });
        }
        if lane.writer.push_frame(frame).is_ok() {
            if let Some(n) = self.frames_by_lane.get_mut(i) {
                *n += 1;
            }
        } else {
            self.frames_malformed += 1;
            if lane.writer.frame_count() == 0 {
                lane.opened_at = None;
            }
        }
    }

    /// Cuts every lane whose flush interval has passed.
    pub fn poll_cut(&mut self, now: u64, out: &mut impl FnMut(Staged)) {
        for i in 0..self.lanes.len() {
            let due = self
                .lanes
                .get(i)
                .and_then(|l| l.opened_at)
                .is_some_and(|t| now.saturating_sub(t) >= self.config.flush_interval_ns);
            if due && let Some(s) = self.cut(i) {
                out(s);
            }
        }
    }

    /// When the next lane falls due.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<u64> {
        self.lanes.iter().filter_map(|l| l.opened_at).min().map(|t| t + self.config.flush_interval_ns)
    }

    /// Cuts every open lane (before counters are handed on, and at shutdown).
    pub fn flush(&mut self, out: &mut impl FnMut(Staged)) {
        for i in 0..self.lanes.len() {
            if let Some(s) = self.cut(i) {
                out(s);
            }
        }
    }

    fn cut(&mut self, i: usize) -> Option<Staged> {
        let lane = self.lanes.get_mut(i)?;
        let opened_ns = lane.opened_at.take()?;
        let writer = std::mem::take(&mut lane.writer);
        let read_ns = std::mem::take(&mut lane.read_ns);
        Some(Staged { lane: Class::from_code(u8::try_from(i).unwrap_or(0)), writer, opened_ns, read_ns })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proto_flat::batch::decode_batch;
    use proto_flat::header::StreamId;
    use proto_flat::sample;
    use zerocopy::IntoBytes;

    fn bulk(seq: u64) -> Vec<u8> {
        sample::bulk_packet(StreamId::new(Class::P2, 1, 0), seq, seq * 10).as_bytes().to_vec()
    }

    #[test]
    fn cuts_by_size_and_by_time_with_running_totals() {
        let cfg = BatcherConfig {
            max_batch_bytes: 48 * 10,
            bulk_batch_bytes: 48 * 10,
            flush_interval_ns: 1_000,
            pool_size: 4,
            pool_bytes: usize::MAX,
        };
        let mut b = Batcher::new(cfg, SessionMeta { node_id: 7, epoch: 1, shipper_session: 3 });
        let mut cut = Vec::new();
        for seq in 0..25 {
            if let Some(x) = b.push(&bulk(seq), 10).unwrap() {
                cut.push(x);
            }
        }
        assert_eq!(cut.len(), 2, "10 frames per batch");
        assert!(b.poll_cut(500).is_none(), "not due yet");
        let last = b.poll_cut(1_010).expect("due");
        assert_eq!(last.frames, 5);
        let seqs: Vec<u64> = cut.iter().chain([&last]).map(|x| x.batch_seq).collect();
        assert_eq!(seqs, [1, 2, 3]);
        let v = decode_batch(&last.bytes).unwrap();
        assert_eq!(v.header.batch_seq.get(), 3);
        assert_eq!(v.header.shipper_session.get(), 3);
        assert_eq!(v.totals().shipped, 25, "running total through this batch");
        assert_eq!(v.summary.iter().next().unwrap().first_seq.get(), 20);
    }

    #[test]
    fn lanes_are_separate_and_flush_cuts_all() {
        let mut b = Batcher::new(BatcherConfig::default(), SessionMeta::default());
        b.push(&bulk(0), 0).unwrap();
        let p0 = sample::collective(StreamId::new(Class::P0, 0, 1), 0, 1, 1, proto_flat::codes::Phase::EnqueueEnd);
        b.push(p0.as_bytes(), 0).unwrap();
        let all = b.flush();
        assert_eq!(all.len(), 2);
        assert_eq!(all[0].lane, Class::P0);
        assert_eq!(all[1].lane, Class::P2);
        assert!(b.flush().is_empty());
    }

    #[test]
    fn a_frame_with_bad_length_is_refused() {
        let mut b = Batcher::new(BatcherConfig::default(), SessionMeta::default());
        let mut f = bulk(0);
        f.truncate(40);
        assert!(b.push(&f, 0).is_err());
    }

    #[test]
    fn pools_hold_at_most_their_byte_cap_and_count_what_they_turn_away() {
        let cfg = BatcherConfig { pool_size: 100, pool_bytes: 1 << 20, ..BatcherConfig::default() };
        let mut b = Batcher::new(cfg, SessionMeta::default());
        // Pre-filled to half the cap: 512 KiB / (64 KiB + 4 KiB) = 7 buffers.
        assert_eq!(b.pooled_bytes(), 7 * (68 << 10));
        // Bulk-sized buffers back from the spool: three fit under 1 MiB, none after.
        for _ in 0..7 {
            b.take_pooled();
        }
        assert_eq!(b.pooled_bytes(), 0);
        for _ in 0..5 {
            b.recycle(Vec::with_capacity(300 << 10));
        }
        assert_eq!(b.pooled_bytes(), 3 * (300 << 10));
        assert_eq!(b.pool_turned_away(), 2);
        // Under pressure the pool is emptied and nothing is kept (nor counted turned away).
        assert_eq!(b.set_pooling(false), 3 * (300 << 10));
        b.recycle(Vec::with_capacity(1024));
        assert_eq!((b.pooled_bytes(), b.pool_turned_away()), (0, 2));

        let mut st = Stager::new(cfg, SessionMeta::default());
        for _ in 0..5 {
            st.give_back(BatchWriter::with_capacity(300 << 10));
        }
        assert!(st.spare_bytes() <= 1 << 20 && st.spare_bytes() >= 3 * (300 << 10), "{}", st.spare_bytes());
        assert_eq!(st.spare_turned_away, 2);
        // A lane opened takes a spare writer and its bytes leave the count.
        let before = st.spare_bytes();
        st.push(&bulk(0), 0, &mut |_| {});
        assert!(st.spare_bytes() < before);
        assert_eq!(st.set_pooling(false), 2);
        assert_eq!(st.spare_bytes(), 0);
    }

    #[test]
    fn a_staged_batch_carries_how_long_its_first_frame_waited_in_the_ring() {
        let cfg = BatcherConfig {
            max_batch_bytes: 1 << 16,
            bulk_batch_bytes: 1 << 16,
            flush_interval_ns: 1_000,
            pool_size: 0,
            pool_bytes: 0,
        };
        let mut st = Stager::new(cfg, SessionMeta::default());
        let mut out = Vec::new();
        // No clock in common: nothing known.
        st.push(&bulk(1), 500, &mut |s| out.push(s));
        st.flush(&mut |s| out.push(s));
        // The source's clock is 1,000 ns ahead of `now`: frame 7 (ts 70) read at now 100
        // (source time 1,100) waited 1,030 ns; the later frames do not change it.
        st.set_mono_offset(Some(1_000));
        st.push(&bulk(7), 100, &mut |s| out.push(s));
        st.push(&bulk(8), 200, &mut |s| out.push(s));
        st.flush(&mut |s| out.push(s));
        // A frame stamped after the pass began reads 1 (known, waited nothing).
        st.push(&bulk(200), 100, &mut |s| out.push(s));
        st.flush(&mut |s| out.push(s));
        assert_eq!(out.iter().map(|s| s.read_ns).collect::<Vec<_>>(), vec![0, 1_030, 1]);
    }
}
