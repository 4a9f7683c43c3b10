//! The batch envelope: what the shipper sends and the aggregator validates.
//!
//! Layout: `BatchHeader (header_len bytes) | payload (payload_len bytes of frames) |
//! stream_summary section`. The summary comes last so a writer appends frames straight
//! into the output buffer (the one copy off the ring) and adds the summary when it cuts.
//!
//! The CRC32C covers the whole envelope with the `crc32c` field read as zero — the
//! payload, as the contract requires, and the header and summary too, so a flipped
//! `node_id` or summary bit is caught as well.
//!
//! Validation order (so each malformation gets its own error): size cap, magic, version,
//! header length, section bounds, total length, checksum; then, with
//! [`BatchView::validate`], framing, lanes, `frame_count` and the summary against the
//! frames.

use alloc::vec::Vec;

use zerocopy::little_endian::{U16, U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::BATCH_MAGIC;
use crate::codes::{Class, DROP_SLOTS, SectionTag, WireEnum};
use crate::decode::{FrameIter, HeaderIter, split_frame};
use crate::error::DecodeError;
use crate::header::{FrameHeader, WIRE_VERSION};
use crate::sections::{Entries, SectionHeader, StreamSummaryEntry, parse_section};

/// The largest batch a reader accepts from a peer.
pub const MAX_BATCH_BYTES: usize = 16 * 1024 * 1024;

/// The envelope's fixed header (152 B).
#[repr(C)]
#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned, Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchHeader {
    /// [`BATCH_MAGIC`] (`"RWB1"` as little-endian bytes).
    pub magic: U32,
    /// Envelope version (1).
    pub version: U16,
    /// Bytes of this header (≥ 152); the payload starts after it.
    pub header_len: U16,
    /// First 8 bytes of SHA-256 of the node's certificate DNS name.
    pub node_id: U64,
    /// Kernel counter lifetime.
    pub epoch: U64,
    /// Shipper process lifetime; scopes `batch_seq`.
    pub shipper_session: U64,
    /// From 1 within the session; dedup key `(node, shipper_session, batch_seq)`.
    pub batch_seq: U64,
    /// Frames in the payload.
    pub frame_count: U32,
    /// Payload bytes.
    pub payload_len: U32,
    /// CRC32C of the whole envelope with this field read as zero.
    pub crc32c: U32,
    /// [`Class`] of every frame in the batch.
    pub lane: u8,
    pub _reserved0: [u8; 3],
    /// Running totals for the session through this batch: frames lost, by cause slot.
    pub lost_total: [U64; DROP_SLOTS],
    /// Running total of frames put into batches.
    pub shipped_total: U64,
    /// Running total of events sampled out (kernel counters summed over streams).
    pub sampled_out_total: U64,
    /// A paired read of host monotonic …
    pub clock_mono_ns: U64,
    /// … and realtime, at the cut.
    pub clock_realtime_ns: U64,
}
const _: () = assert!(size_of::<BatchHeader>() == 152);
const CRC_OFFSET: usize = core::mem::offset_of!(BatchHeader, crc32c);

/// Running totals carried in every envelope, so they survive any one lost record.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RunningTotals {
    /// Lost frames by cause slot (`LossCause::drop_slot`).
    pub lost: [u64; DROP_SLOTS],
    pub shipped: u64,
    pub sampled_out: u64,
}

/// The identity and clock of a batch, set when it is begun.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BatchMeta {
    pub node_id: u64,
    pub epoch: u64,
    pub shipper_session: u64,
    pub batch_seq: u64,
    pub lane: u8,
    pub clock_mono_ns: u64,
    pub clock_realtime_ns: u64,
}

/// CRC32C of an envelope with the checksum field read as zero.
#[must_use]
pub fn envelope_crc(bytes: &[u8]) -> u32 {
    let (head, tail) = bytes.split_at(CRC_OFFSET.min(bytes.len()));
    let after = tail.get(4..).unwrap_or(&[]);
    let crc = crc32c::crc32c(head);
    let crc = crc32c::crc32c_append(crc, &[0; 4]);
    crc32c::crc32c_append(crc, after)
}

/// A batch whose envelope checked out (magic, version, lengths, checksum). Frames are
/// read in place.
#[derive(Debug, Clone, Copy)]
pub struct BatchView<'a> {
    /// The fixed header's v1 prefix.
    pub header: &'a BatchHeader,
    /// The frames, back to back.
    pub payload: &'a [u8],
    /// The stream summary.
    pub summary: Entries<'a, StreamSummaryEntry>,
}

impl<'a> BatchView<'a> {
    /// Checks the envelope of `bytes`. Does not walk the frames (see [`Self::validate`]).
    pub fn parse(bytes: &'a [u8]) -> Result<Self, DecodeError> {
        Self::parse_inner(bytes, true)
    }

    /// [`Self::parse`] without the checksum: for envelopes this process built and holds
    /// (a shipper reading its own spooled batches — their summary per heartbeat, their
    /// streams when acked or dropped — must not checksum megabytes it sealed itself).
    /// Every other check is made; never for bytes from outside.
    pub fn parse_own(bytes: &'a [u8]) -> Result<Self, DecodeError> {
        Self::parse_inner(bytes, false)
    }

    fn parse_inner(bytes: &'a [u8], check_crc: bool) -> Result<Self, DecodeError> {
        if bytes.len() > MAX_BATCH_BYTES {
            return Err(DecodeError::TooLarge { what: "batch", got: bytes.len(), limit: MAX_BATCH_BYTES });
        }
        let magic = bytes.get(..4).and_then(|m| <[u8; 4]>::try_from(m).ok()).map(u32::from_le_bytes);
        match magic {
            None => return Err(DecodeError::TooShort { what: "batch magic", need: 4, got: bytes.len() }),
            Some(m) if m != BATCH_MAGIC => return Err(DecodeError::BadMagic { got: m }),
            Some(_) => {}
        }
        let (header, _) = BatchHeader::ref_from_prefix(bytes).map_err(|_| DecodeError::TooShort {
            what: "batch header",
            need: size_of::<BatchHeader>(),
            got: bytes.len(),
        })?;
        if header.version.get() != WIRE_VERSION {
            return Err(DecodeError::UnsupportedVersion { what: "batch", got: header.version.get() });
        }
        let header_len = usize::from(header.header_len.get());
        if header_len < size_of::<BatchHeader>() {
            return Err(DecodeError::TooShort {
                what: "batch header_len",
                need: size_of::<BatchHeader>(),
                got: header_len,
            });
        }
        let payload_len = usize::try_from(header.payload_len.get()).unwrap_or(usize::MAX);
        let after_header = bytes.get(header_len..).ok_or(DecodeError::LengthMismatch {
            what: "batch header",
            declared: header_len,
            actual: bytes.len(),
        })?;
        let payload = after_header.get(..payload_len).ok_or(DecodeError::LengthMismatch {
            what: "batch payload",
            declared: payload_len,
            actual: after_header.len(),
        })?;
        let summary_bytes = after_header.get(payload_len..).unwrap_or(&[]);
        let (summary, rest) = parse_section::<StreamSummaryEntry>(summary_bytes)?;
        if !rest.is_empty() {
            return Err(DecodeError::LengthMismatch {
                what: "batch",
                declared: bytes.len() - rest.len(),
                actual: bytes.len(),
            });
        }
        if check_crc {
            let computed = envelope_crc(bytes);
            if computed != header.crc32c.get() {
                return Err(DecodeError::ChecksumMismatch { expected: header.crc32c.get(), computed });
            }
        }
        Ok(Self { header, payload, summary })
    }

    /// The batch's lane.
    #[must_use]
    pub fn lane(&self) -> Class {
        Class::from_code(self.header.lane)
    }

    /// Iterate the frames, decoded.
    #[must_use]
    pub fn frames(&self) -> FrameIter<'a> {
        FrameIter::new(self.payload)
    }

    /// Iterate the frame headers only (the bulk seq scan).
    #[must_use]
    pub fn headers(&self) -> HeaderIter<'a> {
        HeaderIter::new(self.payload)
    }

    /// Walks the frames once: framing, every frame's class equals the lane,
    /// `frame_count`, and the summary equals what the frames say (count, min/max seq,
    /// min/max ts per stream; no stream missing or extra). `scratch` is reused between
    /// calls so validation does not allocate in steady state.
    pub fn validate(&self, scratch: &mut SummaryCheck) -> Result<(), DecodeError> {
        scratch.reset(self.summary);
        let lane = self.header.lane;
        let mut rest = self.payload;
        let mut offset = 0usize;
        let mut frames: u64 = 0;
        while !rest.is_empty() {
            let (header, frame, after) = split_frame(rest, offset)?;
            let class = header.stream().class_code();
            if class != lane {
                return Err(DecodeError::LaneMismatch { offset, class, lane });
            }
            scratch.add(header)?;
            frames += 1;
            offset += frame.len();
            rest = after;
        }
        let declared = u64::from(self.header.frame_count.get());
        if frames != declared {
            return Err(DecodeError::LengthMismatch {
                what: "batch frame_count",
                declared: usize::try_from(declared).unwrap_or(usize::MAX),
                actual: usize::try_from(frames).unwrap_or(usize::MAX),
            });
        }
        scratch.finish(self.summary)
    }

    /// The running totals.
    #[must_use]
    pub fn totals(&self) -> RunningTotals {
        let mut lost = [0u64; DROP_SLOTS];
        for (dst, src) in lost.iter_mut().zip(self.header.lost_total.iter()) {
            *dst = src.get();
        }
        RunningTotals {
            lost,
            shipped: self.header.shipped_total.get(),
            sampled_out: self.header.sampled_out_total.get(),
        }
    }
}

#[derive(Debug, Clone, Copy, Default)]
struct Acc {
    stream_id: u32,
    count: u64,
    min_seq: u64,
    max_seq: u64,
    min_ts: u64,
    max_ts: u64,
}

/// Reusable scratch for [`BatchView::validate`].
#[derive(Debug, Default)]
pub struct SummaryCheck {
    acc: Vec<Acc>,
    last: usize,
    index: StreamIndex,
}

/// A direct-mapped cache from a stream id to its position in a batch's summary (streams
/// of one ring interleave frame by frame, so "same as the last frame" misses on most
/// frames and a linear search costs one compare per stream).
#[derive(Debug, Clone)]
struct StreamIndex([u16; STREAM_INDEX_SLOTS]);

const STREAM_INDEX_SLOTS: usize = 64;

impl Default for StreamIndex {
    fn default() -> Self {
        Self([u16::MAX; STREAM_INDEX_SLOTS])
    }
}

impl StreamIndex {
    #[inline]
    fn slot(stream_id: u32) -> usize {
        // The CPU (low bits) varies fastest within a ring; the ring and class bits above.
        (stream_id ^ (stream_id >> 16)) as usize % STREAM_INDEX_SLOTS
    }

    fn clear(&mut self) {
        self.0 = [u16::MAX; STREAM_INDEX_SLOTS];
    }

    /// The cached position of `stream_id`, if the slot holds it (the caller checks the
    /// entry it points at).
    #[inline]
    fn get(&self, stream_id: u32) -> Option<usize> {
        self.0.get(Self::slot(stream_id)).map(|&i| usize::from(i))
    }

    #[inline]
    fn set(&mut self, stream_id: u32, pos: usize) {
        if let (Some(slot), Ok(pos)) = (self.0.get_mut(Self::slot(stream_id)), u16::try_from(pos)) {
            *slot = pos;
        }
    }
}

impl SummaryCheck {
    fn reset(&mut self, summary: Entries<'_, StreamSummaryEntry>) {
        self.acc.clear();
        self.last = 0;
        self.index.clear();
        self.acc.extend(summary.iter().map(|e| Acc {
            stream_id: e.stream_id.get(),
            count: 0,
            min_seq: u64::MAX,
            max_seq: 0,
            min_ts: u64::MAX,
            max_ts: 0,
        }));
    }

    fn add(&mut self, header: &FrameHeader) -> Result<(), DecodeError> {
        let stream_id = header.stream_id.get();
        // Consecutive frames are usually from the same stream: try the last hit first.
        let cached = |i: usize| self.acc.get(i).is_some_and(|a| a.stream_id == stream_id);
        let idx = if cached(self.last) {
            self.last
        } else if let Some(i) = self.index.get(stream_id).filter(|&i| cached(i)) {
            i
        } else {
            let i = self.acc.iter().position(|a| a.stream_id == stream_id).ok_or(DecodeError::SummaryMismatch {
                stream_id,
                field: "frame_count",
                summary: 0,
                frames: 1,
            })?;
            self.index.set(stream_id, i);
            i
        };
        self.last = idx;
        if let Some(a) = self.acc.get_mut(idx) {
            let (seq, ts) = (header.seq.get(), header.ts_ns.get());
            a.count += 1;
            a.min_seq = a.min_seq.min(seq);
            a.max_seq = a.max_seq.max(seq);
            a.min_ts = a.min_ts.min(ts);
            a.max_ts = a.max_ts.max(ts);
        }
        Ok(())
    }

    fn finish(&self, summary: Entries<'_, StreamSummaryEntry>) -> Result<(), DecodeError> {
        for (e, a) in summary.iter().zip(self.acc.iter()) {
            let checks = [
                ("frame_count", u64::from(e.frame_count.get()), a.count),
                ("first_seq", e.first_seq.get(), a.min_seq),
                ("last_seq", e.last_seq.get(), a.max_seq),
                ("first_ts", e.first_ts.get(), a.min_ts),
                ("last_ts", e.last_ts.get(), a.max_ts),
            ];
            for (field, summary, frames) in checks {
                if summary != frames {
                    return Err(DecodeError::SummaryMismatch { stream_id: a.stream_id, field, summary, frames });
                }
            }
        }
        Ok(())
    }
}

/// A fully validated, decoded batch (allocates; for tests, tools and the fuzzer).
pub fn decode_batch(bytes: &[u8]) -> Result<BatchView<'_>, DecodeError> {
    let view = BatchView::parse(bytes)?;
    view.validate(&mut SummaryCheck::default())?;
    Ok(view)
}

/// Builds batches into a reused buffer: `begin`, `push_frame`…, `finish`. After warm-up
/// it does not allocate (the buffer and the summary keep their capacity).
#[derive(Debug, Default)]
pub struct BatchWriter {
    buf: Vec<u8>,
    summary: Vec<StreamSummaryEntry>,
    frame_count: u32,
    lane: u8,
    last: usize,
    index: StreamIndex,
}

impl BatchWriter {
    /// A writer whose buffer starts with room for `bytes`.
    #[must_use]
    pub fn with_capacity(bytes: usize) -> Self {
        Self { buf: Vec::with_capacity(bytes), ..Self::default() }
    }

    /// Bytes of capacity this writer's buffers hold (what keeping it costs).
    #[must_use]
    pub fn buffer_capacity(&self) -> usize {
        self.buf.capacity() + self.summary.capacity() * core::mem::size_of::<StreamSummaryEntry>()
    }

    /// Starts a batch, discarding any unfinished one.
    pub fn begin(&mut self, meta: &BatchMeta) {
        self.buf.clear();
        self.summary.clear();
        self.frame_count = 0;
        self.lane = meta.lane;
        self.last = 0;
        self.index.clear();
        let header = BatchHeader {
            magic: U32::new(BATCH_MAGIC),
            version: U16::new(WIRE_VERSION),
            header_len: U16::new(152),
            node_id: U64::new(meta.node_id),
            epoch: U64::new(meta.epoch),
            shipper_session: U64::new(meta.shipper_session),
            batch_seq: U64::new(meta.batch_seq),
            frame_count: U32::ZERO,
            payload_len: U32::ZERO,
            crc32c: U32::ZERO,
            lane: meta.lane,
            _reserved0: [0; 3],
            lost_total: [U64::ZERO; DROP_SLOTS],
            shipped_total: U64::ZERO,
            sampled_out_total: U64::ZERO,
            clock_mono_ns: U64::new(meta.clock_mono_ns),
            clock_realtime_ns: U64::new(meta.clock_realtime_ns),
        };
        self.buf.extend_from_slice(header.as_bytes());
    }

    /// Payload bytes so far.
    #[must_use]
    pub fn payload_len(&self) -> usize {
        self.buf.len().saturating_sub(size_of::<BatchHeader>())
    }

    /// Frames so far.
    #[must_use]
    pub fn frame_count(&self) -> u32 {
        self.frame_count
    }

    /// The open batch's stream summary so far (one entry per stream: count, seq and
    /// time ranges).
    #[must_use]
    pub fn summary(&self) -> &[StreamSummaryEntry] {
        &self.summary
    }

    /// The open batch's lane code.
    #[must_use]
    pub fn lane(&self) -> u8 {
        self.lane
    }

    /// Copies one frame in unparsed, reading only its header for the summary. The frame
    /// must be exactly `header.length` bytes and of the batch's lane.
    pub fn push_frame(&mut self, frame: &[u8]) -> Result<(), DecodeError> {
        let (header, whole, rest) = split_frame(frame, 0)?;
        if !rest.is_empty() {
            return Err(DecodeError::LengthMismatch { what: "frame", declared: whole.len(), actual: frame.len() });
        }
        let class = header.stream().class_code();
        if class != self.lane {
            return Err(DecodeError::LaneMismatch { offset: self.payload_len(), class, lane: self.lane });
        }
        if self.payload_len() + frame.len() > MAX_BATCH_BYTES / 2 {
            return Err(DecodeError::TooLarge {
                what: "batch payload",
                got: self.payload_len() + frame.len(),
                limit: MAX_BATCH_BYTES / 2,
            });
        }
        let (stream_id, seq, ts) = (header.stream_id.get(), header.seq.get(), header.ts_ns.get());
        let cached = |i: usize| self.summary.get(i).is_some_and(|e| e.stream_id.get() == stream_id);
        let idx = if cached(self.last) {
            Some(self.last)
        } else if let Some(i) = self.index.get(stream_id).filter(|&i| cached(i)) {
            Some(i)
        } else {
            let found = self.summary.iter().position(|e| e.stream_id.get() == stream_id);
            if let Some(i) = found {
                self.index.set(stream_id, i);
            }
            found
        };
        match idx.and_then(|i| self.summary.get_mut(i).map(|e| (i, e))) {
            Some((i, e)) => {
                self.last = i;
                e.frame_count = U32::new(e.frame_count.get().saturating_add(1));
                e.first_seq = U64::new(e.first_seq.get().min(seq));
                e.last_seq = U64::new(e.last_seq.get().max(seq));
                e.first_ts = U64::new(e.first_ts.get().min(ts));
                e.last_ts = U64::new(e.last_ts.get().max(ts));
            }
            None => {
                self.last = self.summary.len();
                self.index.set(stream_id, self.last);
                self.summary.push(StreamSummaryEntry {
                    stream_id: U32::new(stream_id),
                    frame_count: U32::new(1),
                    first_seq: U64::new(seq),
                    last_seq: U64::new(seq),
                    first_ts: U64::new(ts),
                    last_ts: U64::new(ts),
                });
            }
        }
        // The bulk frame size copied as a fixed-size array (inline moves, no memcpy call:
        // 9 % of a batch build, `cargo bench -p proto-flat --bench decode`, `build`).
        match <&[u8; 48]>::try_from(frame) {
            Ok(fixed) => self.buf.extend_from_slice(fixed),
            Err(_) => self.buf.extend_from_slice(frame),
        }
        self.frame_count += 1;
        Ok(())
    }

    /// Ends the batch: appends the summary, fills counts and totals, seals the CRC.
    /// The bytes stay valid until the next `begin`.
    pub fn finish(&mut self, totals: &RunningTotals) -> &[u8] {
        let payload_len = self.payload_len();
        let section = SectionHeader {
            tag: U16::new(SectionTag::StreamSummary.code()),
            entry_len: U16::new(40),
            count: U32::new(u32::try_from(self.summary.len()).unwrap_or(u32::MAX)),
        };
        self.buf.extend_from_slice(section.as_bytes());
        for e in &self.summary {
            self.buf.extend_from_slice(e.as_bytes());
        }
        if let Ok((header, _)) = BatchHeader::mut_from_prefix(&mut self.buf) {
            header.frame_count = U32::new(self.frame_count);
            // push_frame caps the payload at MAX_BATCH_BYTES / 2.
            header.payload_len = U32::new(u32::try_from(payload_len).unwrap_or(u32::MAX));
            for (dst, src) in header.lost_total.iter_mut().zip(totals.lost.iter()) {
                *dst = U64::new(*src);
            }
            header.shipped_total = U64::new(totals.shipped);
            header.sampled_out_total = U64::new(totals.sampled_out);
        }
        let crc = envelope_crc(&self.buf);
        if let Some(field) = self.buf.get_mut(CRC_OFFSET..CRC_OFFSET + 4) {
            field.copy_from_slice(&crc.to_le_bytes());
        }
        &self.buf
    }
}

impl BatchWriter {
    /// Sets the open batch's `batch_seq` (a shipper numbers batches when it cuts them).
    pub fn set_batch_seq(&mut self, batch_seq: u64) {
        if let Ok((header, _)) = BatchHeader::mut_from_prefix(&mut self.buf) {
            header.batch_seq = U64::new(batch_seq);
        }
    }

    /// Ends the batch like [`Self::finish`] and hands its buffer out, taking
    /// `replacement` (an empty buffer, e.g. from a pool) for the next batch, so a batch
    /// leaves without a copy and buffers circulate without allocation.
    pub fn finish_swap(&mut self, totals: &RunningTotals, mut replacement: Vec<u8>) -> Vec<u8> {
        let _ = self.finish(totals);
        replacement.clear();
        std::mem::swap(&mut self.buf, &mut replacement);
        replacement
    }
}

/// Recomputes and stores the CRC of an envelope (for tests that mutate a batch and want
/// the next check to be reached).
pub fn reseal(bytes: &mut [u8]) {
    let crc = envelope_crc(bytes);
    if let Some(field) = bytes.get_mut(CRC_OFFSET..CRC_OFFSET + 4) {
        field.copy_from_slice(&crc.to_le_bytes());
    }
}
