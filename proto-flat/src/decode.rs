//! Iterating frames laid back to back (a batch payload, a capture file, a ring drain).
//!
//! Invariants:
//! - never panics and never reads past the slice, whatever the bytes;
//! - a frame of unknown kind or unsupported version is skipped by its `length` and
//!   counted, and still yields its header so its seq is accounted for;
//! - a frame that is framed correctly but whose body is bad (too short for its kind, a
//!   section past its end) yields [`Frame::Malformed`] with the error and its header, and
//!   iteration goes on: one bad frame never costs its neighbours;
//! - a framing error (unreadable header, bad `length`) ends the iteration: the rest of
//!   the buffer cannot be framed. The error says at which offset.

use zerocopy::FromBytes;

use crate::codes::{FrameKind, WireEnum};
use crate::error::DecodeError;
use crate::frames::{
    BulkPacketFrame, BulkProxyFrame, CollectiveFrame, EpochStartFrame, FixedFrame, LossRecordFrame, P2pFrame,
    ShipperGapFrame,
};
use crate::header::{FRAME_ALIGN, FrameHeader, WIRE_VERSION};
use crate::sections::{Heartbeat, SessionStart};

/// One decoded frame, borrowed from the buffer.
#[derive(Debug, Clone)]
pub enum Frame<'a> {
    Collective(&'a CollectiveFrame),
    P2p(&'a P2pFrame),
    BulkPacket(&'a BulkPacketFrame),
    BulkProxy(&'a BulkProxyFrame),
    Heartbeat(Heartbeat<'a>),
    LossRecord(&'a LossRecordFrame),
    SessionStart(SessionStart<'a>),
    ShipperGap(&'a ShipperGapFrame),
    EpochStart(&'a EpochStartFrame),
    /// A kind or version this reader does not know: header readable, body skipped.
    Unknown {
        header: &'a FrameHeader,
        bytes: &'a [u8],
    },
    /// A known kind whose body does not decode; the header is still good for accounting.
    Malformed {
        header: &'a FrameHeader,
        bytes: &'a [u8],
        error: DecodeError,
    },
}

impl<'a> Frame<'a> {
    /// The frame's header.
    #[must_use]
    pub fn header(&self) -> &'a FrameHeader {
        match *self {
            Self::Collective(f) => &f.hdr,
            Self::P2p(f) => &f.hdr,
            Self::BulkPacket(f) => &f.hdr,
            Self::BulkProxy(f) => &f.hdr,
            Self::Heartbeat(h) => h.header,
            Self::LossRecord(f) => &f.hdr,
            Self::SessionStart(s) => s.header,
            Self::ShipperGap(f) => &f.hdr,
            Self::EpochStart(f) => &f.hdr,
            Self::Unknown { header, .. } | Self::Malformed { header, .. } => header,
        }
    }
}

/// Reads the frame at the front of `bytes`: `(header, whole frame, rest)`.
///
/// Checks only what framing needs: a readable header and a `length` that is at least the
/// header, a multiple of 8 and within the buffer. `offset` is for error context.
#[inline]
pub fn split_frame(bytes: &[u8], offset: usize) -> Result<(&FrameHeader, &[u8], &[u8]), DecodeError> {
    let (header, _) = FrameHeader::ref_from_prefix(bytes).map_err(|_| DecodeError::TooShort {
        what: "frame header",
        need: size_of::<FrameHeader>(),
        got: bytes.len(),
    })?;
    let length = header.length.get();
    let len = usize::try_from(length).unwrap_or(usize::MAX);
    if len < size_of::<FrameHeader>() || !len.is_multiple_of(FRAME_ALIGN) {
        return Err(DecodeError::BadFrameLength { offset, length });
    }
    if len > bytes.len() {
        return Err(DecodeError::LengthMismatch { what: "frame", declared: len, actual: bytes.len() });
    }
    let (frame, rest) = bytes.split_at(len);
    Ok((header, frame, rest))
}

#[inline]
fn fixed<T: FixedFrame>(frame: &[u8]) -> Result<&T, DecodeError> {
    T::ref_from_prefix(frame).map(|(f, _)| f).map_err(|_| DecodeError::TooShort {
        what: T::KIND.name().unwrap_or("frame"),
        need: size_of::<T>(),
        got: frame.len(),
    })
}

/// Decodes one framed frame (as returned by [`split_frame`]).
#[inline]
pub fn decode_frame<'a>(header: &'a FrameHeader, frame: &'a [u8]) -> Result<Frame<'a>, DecodeError> {
    if header.version.get() != WIRE_VERSION {
        return Ok(Frame::Unknown { header, bytes: frame });
    }
    Ok(match header.kind() {
        FrameKind::Collective => Frame::Collective(fixed(frame)?),
        FrameKind::P2p => Frame::P2p(fixed(frame)?),
        FrameKind::BulkPacket => Frame::BulkPacket(fixed(frame)?),
        FrameKind::BulkProxy => Frame::BulkProxy(fixed(frame)?),
        FrameKind::LossRecord => Frame::LossRecord(fixed(frame)?),
        FrameKind::ShipperGap => Frame::ShipperGap(fixed(frame)?),
        FrameKind::EpochStart => Frame::EpochStart(fixed(frame)?),
        FrameKind::Heartbeat => Frame::Heartbeat(Heartbeat::parse(header, frame)?),
        FrameKind::SessionStart => Frame::SessionStart(SessionStart::parse(header, frame)?),
        FrameKind::Unrecognized(_) => Frame::Unknown { header, bytes: frame },
    })
}

/// Counts of what the iterator skipped.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SkipCounts {
    /// Frames of a kind this reader does not know.
    pub unknown_kind: u64,
    /// Frames of a known kind with a version this reader does not know.
    pub unsupported_version: u64,
    /// Frames of a known kind whose body did not decode ([`Frame::Malformed`]).
    pub malformed: u64,
}

/// Iterator over frames laid back to back. See the module docs for its guarantees.
#[derive(Debug, Clone)]
pub struct FrameIter<'a> {
    rest: &'a [u8],
    offset: usize,
    failed: bool,
    skipped: SkipCounts,
}

impl<'a> FrameIter<'a> {
    /// Iterate the frames in `bytes`.
    #[must_use]
    pub fn new(bytes: &'a [u8]) -> Self {
        Self { rest: bytes, offset: 0, failed: false, skipped: SkipCounts::default() }
    }

    /// What has been skipped so far.
    #[must_use]
    pub fn skipped(&self) -> SkipCounts {
        self.skipped
    }

    /// Byte offset of the next frame.
    #[must_use]
    pub fn offset(&self) -> usize {
        self.offset
    }
}

impl<'a> Iterator for FrameIter<'a> {
    type Item = Result<Frame<'a>, DecodeError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed || self.rest.is_empty() {
            return None;
        }
        let (header, frame, rest) = match split_frame(self.rest, self.offset) {
            Ok(split) => split,
            Err(e) => {
                self.failed = true;
                return Some(Err(e));
            }
        };
        self.offset += frame.len();
        self.rest = rest;
        let decoded = match decode_frame(header, frame) {
            Ok(decoded) => decoded,
            Err(error) => Frame::Malformed { header, bytes: frame, error },
        };
        match decoded {
            Frame::Unknown { header, .. } if header.version.get() == WIRE_VERSION => self.skipped.unknown_kind += 1,
            Frame::Unknown { .. } => self.skipped.unsupported_version += 1,
            Frame::Malformed { .. } => self.skipped.malformed += 1,
            _ => {}
        }
        let result = Ok(decoded);
        Some(result)
    }
}

/// Framing-only iterator: yields each frame's header and bytes without decoding bodies.
/// The aggregator's bulk path uses it for the per-stream seq scan (bulk frames never
/// become records one by one). Same framing checks and fusing as [`FrameIter`].
#[derive(Debug, Clone)]
pub struct HeaderIter<'a> {
    rest: &'a [u8],
    offset: usize,
}

impl<'a> HeaderIter<'a> {
    /// Iterate the frame headers in `bytes`.
    #[must_use]
    pub fn new(bytes: &'a [u8]) -> Self {
        Self { rest: bytes, offset: 0 }
    }
}

impl<'a> Iterator for HeaderIter<'a> {
    type Item = Result<(&'a FrameHeader, &'a [u8]), DecodeError>;

    #[inline]
    fn next(&mut self) -> Option<Self::Item> {
        if self.rest.is_empty() {
            return None;
        }
        match split_frame(self.rest, self.offset) {
            Ok((header, frame, rest)) => {
                self.offset += frame.len();
                self.rest = rest;
                Some(Ok((header, frame)))
            }
            Err(e) => {
                self.rest = &[];
                Some(Err(e))
            }
        }
    }
}
