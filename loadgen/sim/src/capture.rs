//! Capture files: ring records plus timestamped counter snapshots, per node.
//!
//! Layout (little-endian, every record 8-aligned):
//!
//! ```text
//! file header (32 B): magic "RWCAPv1\0" | version u16 | reserved u16 | node_count u32
//!                     | seed u64 | reserved u64
//! record* : record header (16 B): kind u16 | reserved u16 | node u32 | len u32 | reserved u32
//!           then `len` bytes, then zero padding to a multiple of 8
//!   kind 1 ring record — one proto-flat frame exactly as read off the ring
//!   kind 2 snapshot    — a proto-flat heartbeat frame: sections streams, progress,
//!                        clock_realtime; head.snapshot_ns = node monotonic time
//!   kind 3 epoch       — a proto-flat epoch_start frame (header ts = node monotonic)
//! ```
//!
//! A replay source yields the ring records as frames and the snapshots as counters; the
//! shipper builds its own envelopes and heartbeats from them. Payloads are proto-flat
//! bytes, so a capture round-trips bit-exact through proto-flat's decoder.
//!
//! The reader never panics on any input: a short or inconsistent record is a
//! [`CaptureError`] with the byte offset.

use std::io::Write;

use proto_flat::decode::{Frame, FrameIter};
use proto_flat::encode::SectionedFrameWriter;
use proto_flat::frames::{EpochStartFrame, FixedFrame};
use proto_flat::header::StreamId;
use proto_flat::sections::{ClockRealtimeEntry, Heartbeat, InterfaceEntry, ProgressEntry, Section, StreamEntry};
use proto_flat::{Class, DecodeError};
use zerocopy::little_endian::{U16, U32, U64};
use zerocopy::{FromBytes, FromZeros, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::sim::{EpochInfo, Sink, Snapshot};

/// First bytes of every capture file.
pub const CAPTURE_MAGIC: [u8; 8] = *b"RWCAPv1\0";
/// Capture format version.
pub const CAPTURE_VERSION: u16 = 1;
/// The largest record a reader accepts.
pub const MAX_RECORD_BYTES: usize = 1 << 20;

/// The capture's own P1 stream for snapshot and epoch frames.
const CAPTURE_STREAM: StreamId = StreamId::new(Class::P1, StreamId::SHIPPER_RING, 0);

/// File header (32 B).
#[repr(C)]
#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned, Clone, Copy, Debug, PartialEq, Eq)]
pub struct CaptureHeader {
    pub magic: [u8; 8],
    pub version: U16,
    pub _reserved0: [u8; 2],
    pub node_count: U32,
    pub seed: U64,
    pub _reserved1: [u8; 8],
}
const _: () = assert!(size_of::<CaptureHeader>() == 32);

/// Record header (16 B).
#[repr(C)]
#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned, Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecordHeader {
    pub kind: U16,
    pub _reserved0: [u8; 2],
    pub node: U32,
    pub len: U32,
    pub _reserved1: [u8; 4],
}
const _: () = assert!(size_of::<RecordHeader>() == 16);

/// Record kinds.
pub mod kind {
    pub const FRAME: u16 = 1;
    pub const SNAPSHOT: u16 = 2;
    pub const EPOCH: u16 = 3;
}

/// Why a capture could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum CaptureError {
    #[error("not a ringwatch capture (magic {got:02x?})")]
    BadMagic { got: Vec<u8> },
    #[error("unsupported capture version {got}")]
    UnsupportedVersion { got: u16 },
    #[error("capture truncated at byte {offset}: need {need} more bytes, {got} left")]
    Truncated { offset: usize, need: usize, got: usize },
    #[error("record at byte {offset} is {len} bytes, over the {MAX_RECORD_BYTES}-byte limit")]
    TooLarge { offset: usize, len: usize },
    #[error("record at byte {offset}: unknown kind {kind}")]
    UnknownKind { offset: usize, kind: u16 },
    #[error("record at byte {offset}: {source}")]
    Frame { offset: usize, source: DecodeError },
    #[error("record at byte {offset}: expected a {want} frame")]
    WrongFrame { offset: usize, want: &'static str },
    #[error("writing the capture: {0}")]
    Io(#[from] std::io::Error),
}

/// Writes a capture; use it as the simulation's [`Sink`]. The first I/O error is kept
/// and returned by [`CaptureWriter::finish`]; later records are not written.
#[derive(Debug)]
pub struct CaptureWriter<W: Write> {
    out: W,
    error: Option<std::io::Error>,
    snapshots: u64,
    records: u64,
}

impl<W: Write> CaptureWriter<W> {
    /// Writes the file header.
    pub fn new(mut out: W, node_count: u32, seed: u64) -> Result<Self, CaptureError> {
        let h = CaptureHeader {
            magic: CAPTURE_MAGIC,
            version: U16::new(CAPTURE_VERSION),
            _reserved0: [0; 2],
            node_count: U32::new(node_count),
            seed: U64::new(seed),
            _reserved1: [0; 8],
        };
        out.write_all(h.as_bytes())?;
        Ok(Self { out, error: None, snapshots: 0, records: 0 })
    }

    fn record(&mut self, kind: u16, node: u32, payload: &[u8]) {
        if self.error.is_some() {
            return;
        }
        let len = u32::try_from(payload.len()).unwrap_or(u32::MAX);
        let h = RecordHeader {
            kind: U16::new(kind),
            _reserved0: [0; 2],
            node: U32::new(node),
            len: U32::new(len),
            _reserved1: [0; 4],
        };
        let pad = (8 - payload.len() % 8) % 8;
        let result = self
            .out
            .write_all(h.as_bytes())
            .and_then(|()| self.out.write_all(payload))
            .and_then(|()| self.out.write_all(&[0u8; 8][..pad]));
        match result {
            Ok(()) => self.records += 1,
            Err(e) => self.error = Some(e),
        }
    }

    /// Records written so far.
    #[must_use]
    pub fn records(&self) -> u64 {
        self.records
    }

    /// Flushes and returns the writer, or the first error.
    pub fn finish(mut self) -> Result<W, CaptureError> {
        if let Some(e) = self.error.take() {
            return Err(e.into());
        }
        self.out.flush()?;
        Ok(self.out)
    }
}

/// Encodes a snapshot as a heartbeat frame (streams, progress, clock_realtime, and
/// interfaces when it has any).
#[must_use]
pub fn snapshot_frame(seq: u64, snapshot: &Snapshot<'_>) -> Vec<u8> {
    let clock = ClockRealtimeEntry { mono_ns: U64::new(snapshot.mono_ns), realtime_ns: U64::new(snapshot.realtime_ns) };
    let mut w = SectionedFrameWriter::heartbeat(CAPTURE_STREAM, seq, snapshot.mono_ns, snapshot.mono_ns);
    w.section(snapshot.streams).section(snapshot.progress).section(&[clock]);
    if !snapshot.interfaces.is_empty() {
        w.section(snapshot.interfaces);
    }
    w.finish()
}

/// The counters of a snapshot record (v1 prefixes).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SnapshotCounters {
    pub streams: Vec<StreamEntry>,
    pub progress: Vec<ProgressEntry>,
    pub interfaces: Vec<InterfaceEntry>,
}

/// The counters of a snapshot record: its streams, PROGRESS entries and interfaces.
#[must_use]
pub fn snapshot_counters(heartbeat: &Heartbeat<'_>) -> SnapshotCounters {
    let mut out = SnapshotCounters::default();
    for section in heartbeat.sections() {
        match section {
            Section::Streams(e) => out.streams.extend(e.iter().copied()),
            Section::Progress(e) => out.progress.extend(e.iter().copied()),
            Section::Interfaces(e) => out.interfaces.extend(e.iter().copied()),
            _ => {}
        }
    }
    out
}

/// Encodes an epoch start.
#[must_use]
pub fn epoch_frame(info: &EpochInfo) -> EpochStartFrame {
    let mut f = EpochStartFrame::new_zeroed();
    f.hdr = EpochStartFrame::make_header(0, CAPTURE_STREAM, info.epoch, info.mono_ns);
    f.epoch = U64::new(info.epoch);
    f.start_realtime_ns = U64::new(info.start_realtime_ns);
    f.boot_id = info.boot_id;
    f
}

impl<W: Write> Sink for CaptureWriter<W> {
    fn frame(&mut self, node: u32, frame: &[u8]) {
        self.record(kind::FRAME, node, frame);
    }

    fn snapshot(&mut self, node: u32, snapshot: &Snapshot<'_>) {
        self.snapshots += 1;
        let frame = snapshot_frame(self.snapshots, snapshot);
        self.record(kind::SNAPSHOT, node, &frame);
    }

    fn epoch(&mut self, node: u32, info: &EpochInfo) {
        let f = epoch_frame(info);
        self.record(kind::EPOCH, node, f.as_bytes());
    }
}

/// One record of a capture, borrowed from the file's bytes.
#[derive(Debug, Clone)]
pub enum CaptureRecord<'a> {
    /// A ring record: one frame as read off the ring.
    Frame { node: u32, bytes: &'a [u8], frame: Frame<'a> },
    /// Counters at a heartbeat instant.
    Snapshot { node: u32, bytes: &'a [u8], heartbeat: Heartbeat<'a> },
    /// A new epoch.
    Epoch { node: u32, bytes: &'a [u8], frame: &'a EpochStartFrame },
}

/// Reads a capture held in memory (mmap or read the file). Iterates records; after the
/// first error the iterator ends.
#[derive(Debug, Clone)]
pub struct CaptureReader<'a> {
    header: CaptureHeader,
    rest: &'a [u8],
    offset: usize,
}

impl<'a> CaptureReader<'a> {
    /// Checks the file header.
    pub fn new(bytes: &'a [u8]) -> Result<Self, CaptureError> {
        let (header, rest) = CaptureHeader::read_from_prefix(bytes).map_err(|_| CaptureError::Truncated {
            offset: 0,
            need: size_of::<CaptureHeader>(),
            got: bytes.len(),
        })?;
        if header.magic != CAPTURE_MAGIC {
            return Err(CaptureError::BadMagic { got: header.magic.to_vec() });
        }
        if header.version.get() != CAPTURE_VERSION {
            return Err(CaptureError::UnsupportedVersion { got: header.version.get() });
        }
        Ok(Self { header, rest, offset: size_of::<CaptureHeader>() })
    }

    /// A reader positioned at `offset` (a value [`Self::offset`] returned), for a
    /// source that reads a capture in several passes.
    pub fn resume(bytes: &'a [u8], offset: usize) -> Result<Self, CaptureError> {
        let mut r = Self::new(bytes)?;
        let start = offset.max(size_of::<CaptureHeader>());
        r.rest = bytes.get(start..).ok_or(CaptureError::Truncated { offset: start, need: 0, got: bytes.len() })?;
        r.offset = start;
        Ok(r)
    }

    /// Byte offset of the next record.
    #[must_use]
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Nodes in the capture.
    #[must_use]
    pub fn node_count(&self) -> u32 {
        self.header.node_count.get()
    }

    /// The simulation seed that produced it.
    #[must_use]
    pub fn seed(&self) -> u64 {
        self.header.seed.get()
    }

    fn read(&mut self) -> Result<CaptureRecord<'a>, CaptureError> {
        let offset = self.offset;
        let (h, body) = RecordHeader::read_from_prefix(self.rest).map_err(|_| CaptureError::Truncated {
            offset,
            need: size_of::<RecordHeader>(),
            got: self.rest.len(),
        })?;
        let len = usize::try_from(h.len.get()).unwrap_or(usize::MAX);
        if len > MAX_RECORD_BYTES {
            return Err(CaptureError::TooLarge { offset, len });
        }
        let padded = len + (8 - len % 8) % 8;
        let bytes = body.get(..len).ok_or(CaptureError::Truncated { offset, need: len, got: body.len() })?;
        let node = h.node.get();
        let frame_err = |source| CaptureError::Frame { offset, source };
        let record = match h.kind.get() {
            kind::FRAME | kind::SNAPSHOT | kind::EPOCH => {
                let mut it = FrameIter::new(bytes);
                let frame =
                    it.next().ok_or(CaptureError::Truncated { offset, need: 32, got: 0 })?.map_err(frame_err)?;
                if it.offset() != bytes.len() {
                    return Err(frame_err(DecodeError::LengthMismatch {
                        what: "capture record",
                        declared: len,
                        actual: it.offset(),
                    }));
                }
                match (h.kind.get(), frame) {
                    (kind::SNAPSHOT, Frame::Heartbeat(heartbeat)) => CaptureRecord::Snapshot { node, bytes, heartbeat },
                    (kind::SNAPSHOT, _) => return Err(CaptureError::WrongFrame { offset, want: "heartbeat" }),
                    (kind::EPOCH, Frame::EpochStart(frame)) => CaptureRecord::Epoch { node, bytes, frame },
                    (kind::EPOCH, _) => return Err(CaptureError::WrongFrame { offset, want: "epoch_start" }),
                    (_, frame) => CaptureRecord::Frame { node, bytes, frame },
                }
            }
            other => return Err(CaptureError::UnknownKind { offset, kind: other }),
        };
        let advance = size_of::<RecordHeader>() + padded;
        self.rest = self.rest.get(advance..).unwrap_or(&[]);
        self.offset += advance;
        Ok(record)
    }
}

impl<'a> Iterator for CaptureReader<'a> {
    type Item = Result<CaptureRecord<'a>, CaptureError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.rest.is_empty() {
            return None;
        }
        let r = self.read();
        if r.is_err() {
            self.rest = &[];
        }
        Some(r)
    }
}
