//! The 32-byte frame header every frame starts with, and the stream id.
//!
//! Invariant: the header's layout is frozen across wire versions. A reader that does not
//! know a frame's kind or version can still read its length (to skip it) and its stream
//! and seq (to account for it), so an unknown frame is never a sequence gap.

use core::fmt;

use zerocopy::little_endian::{U16, U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::codes::{Class, FrameKind, WireEnum};

/// Wire version of every v1 frame layout and of the batch envelope.
pub const WIRE_VERSION: u16 = 1;

/// Frames are padded to a multiple of this, so C writers keep natural alignment when
/// frames are laid back to back (BPF ring records are 8-aligned too).
pub const FRAME_ALIGN: usize = 8;

/// The frame header (32 B).
#[repr(C)]
#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    /// Layout version of this frame kind (1).
    pub version: U16,
    /// [`FrameKind`] code.
    pub kind: U16,
    /// Bits of [`crate::codes::flags`].
    pub flags: U32,
    /// Whole frame length in bytes, header included; a multiple of 8, at least 32.
    pub length: U32,
    /// `class:8 | ring:8 | cpu:16` — see [`StreamId`]. The class lives only here.
    pub stream_id: U32,
    /// Per-stream sequence number, taken in the kernel (or shipper, for P1) before the
    /// ring reserve; starts at 0 in each epoch.
    pub seq: U64,
    /// Event time, ns, on the clock `flags` names (host `CLOCK_MONOTONIC` by default).
    pub ts_ns: U64,
}

const _: () = assert!(size_of::<FrameHeader>() == 32);

impl FrameHeader {
    /// A v1 header.
    #[must_use]
    pub fn new(kind: FrameKind, flags: u32, length: u32, stream: StreamId, seq: u64, ts_ns: u64) -> Self {
        Self {
            version: U16::new(WIRE_VERSION),
            kind: U16::new(kind.code()),
            flags: U32::new(flags),
            length: U32::new(length),
            stream_id: U32::new(stream.0),
            seq: U64::new(seq),
            ts_ns: U64::new(ts_ns),
        }
    }

    /// The frame kind.
    #[must_use]
    pub fn kind(&self) -> FrameKind {
        FrameKind::from_code(self.kind.get())
    }

    /// The stream this frame belongs to.
    #[must_use]
    pub fn stream(&self) -> StreamId {
        StreamId(self.stream_id.get())
    }

    /// Whether a flag bit is set.
    #[must_use]
    pub fn has_flag(&self, bit: u32) -> bool {
        self.flags.get() & bit != 0
    }
}

impl fmt::Debug for FrameHeader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FrameHeader")
            .field("version", &self.version.get())
            .field("kind", &self.kind())
            .field("flags", &format_args!("{:#x}", self.flags.get()))
            .field("length", &self.length.get())
            .field("stream", &self.stream())
            .field("seq", &self.seq.get())
            .field("ts_ns", &self.ts_ns.get())
            .finish()
    }
}

/// `class:8 | ring:8 | cpu:16`. Each (ring, CPU) has its own counters; P0 and bulk rings
/// never share one.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct StreamId(pub u32);

impl StreamId {
    /// Ring number the shipper uses for its own P1 frames (heartbeats, loss records).
    pub const SHIPPER_RING: u8 = 0xff;

    /// Compose a stream id.
    #[must_use]
    pub const fn new(class: Class, ring: u8, cpu: u16) -> Self {
        Self(((class.code_const() as u32) << 24) | ((ring as u32) << 16) | cpu as u32)
    }

    /// The priority class.
    #[must_use]
    pub fn class(self) -> Class {
        Class::from_code(self.class_code())
    }

    /// The raw class byte.
    #[must_use]
    pub const fn class_code(self) -> u8 {
        self.0.to_le_bytes()[3]
    }

    /// The ring number.
    #[must_use]
    pub const fn ring(self) -> u8 {
        self.0.to_le_bytes()[2]
    }

    /// The CPU.
    #[must_use]
    pub const fn cpu(self) -> u16 {
        let b = self.0.to_le_bytes();
        u16::from_le_bytes([b[0], b[1]])
    }
}

impl fmt::Debug for StreamId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/r{}/c{}", self.class(), self.ring(), self.cpu())
    }
}

impl fmt::Display for StreamId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_id_packs_class_ring_cpu() {
        let s = StreamId::new(Class::P2, 3, 0x1234);
        assert_eq!(s.0, 0x0203_1234);
        assert_eq!(s.class(), Class::P2);
        assert_eq!(s.ring(), 3);
        assert_eq!(s.cpu(), 0x1234);
        assert_eq!(StreamId(0xff00_0000).class(), Class::Unrecognized(0xff));
    }
}
