//! Writers for sectioned frames (heartbeat, session_start). Fixed frames are plain
//! structs: fill one (`FromZeros::new_zeroed`, then the fields, then
//! `hdr = T::make_header(..)`) and take `as_bytes()`. Batches: [`crate::batch::BatchWriter`].

use alloc::vec::Vec;

use zerocopy::IntoBytes;
use zerocopy::little_endian::{U16, U32, U64};

use crate::codes::{FrameKind, WireEnum};
use crate::header::{FRAME_ALIGN, FrameHeader, StreamId};
use crate::sections::{Entry, HeartbeatHead, SectionHeader, SessionStartHead};

/// Offsets of the fields `finish` patches.
const LENGTH_AT: usize = core::mem::offset_of!(FrameHeader, length);
const SECTION_COUNT_AT: usize = size_of::<FrameHeader>() + core::mem::offset_of!(HeartbeatHead, section_count);
const _: () = assert!(
    core::mem::offset_of!(HeartbeatHead, section_count) == core::mem::offset_of!(SessionStartHead, section_count)
);

/// Builds one heartbeat or session_start frame.
#[derive(Debug)]
pub struct SectionedFrameWriter {
    buf: Vec<u8>,
    sections: u32,
}

impl SectionedFrameWriter {
    fn start(kind: FrameKind, stream: StreamId, seq: u64, ts_ns: u64, head: &[u8]) -> Self {
        let mut buf = Vec::with_capacity(256);
        buf.extend_from_slice(FrameHeader::new(kind, 0, 0, stream, seq, ts_ns).as_bytes());
        buf.extend_from_slice(head);
        Self { buf, sections: 0 }
    }

    /// A heartbeat whose counters were read at `snapshot_ns`.
    #[must_use]
    pub fn heartbeat(stream: StreamId, seq: u64, ts_ns: u64, snapshot_ns: u64) -> Self {
        let head =
            HeartbeatHead { head_len: U32::new(16), section_count: U32::ZERO, snapshot_ns: U64::new(snapshot_ns) };
        Self::start(FrameKind::Heartbeat, stream, seq, ts_ns, head.as_bytes())
    }

    /// A session_start for `shipper_session`.
    #[must_use]
    pub fn session_start(stream: StreamId, seq: u64, ts_ns: u64, shipper_session: u64) -> Self {
        let head = SessionStartHead {
            head_len: U32::new(16),
            section_count: U32::ZERO,
            shipper_session: U64::new(shipper_session),
        };
        Self::start(FrameKind::SessionStart, stream, seq, ts_ns, head.as_bytes())
    }

    /// Appends a section holding `entries`.
    pub fn section<T: Entry>(&mut self, entries: &[T]) -> &mut Self {
        #[allow(
            clippy::cast_possible_truncation,
            reason = "v1 entries are at most 104 B; a section holds far fewer than 2^32 entries"
        )]
        let sh = SectionHeader {
            tag: U16::new(T::TAG.code()),
            entry_len: U16::new(size_of::<T>() as u16),
            count: U32::new(entries.len() as u32),
        };
        self.buf.extend_from_slice(sh.as_bytes());
        for e in entries {
            self.buf.extend_from_slice(e.as_bytes());
        }
        self.sections += 1;
        self
    }

    /// Pads to 8 bytes, patches `length` and `section_count`, returns the frame.
    #[must_use]
    pub fn finish(mut self) -> Vec<u8> {
        while !self.buf.len().is_multiple_of(FRAME_ALIGN) {
            self.buf.push(0);
        }
        let len = u32::try_from(self.buf.len()).unwrap_or(u32::MAX);
        if let Some(f) = self.buf.get_mut(LENGTH_AT..LENGTH_AT + 4) {
            f.copy_from_slice(&len.to_le_bytes());
        }
        if let Some(f) = self.buf.get_mut(SECTION_COUNT_AT..SECTION_COUNT_AT + 4) {
            f.copy_from_slice(&self.sections.to_le_bytes());
        }
        self.buf
    }
}
