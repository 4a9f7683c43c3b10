//! Decode errors, with the context a person needs to find the bad byte.

use crate::codes::NackReason;

/// Why bytes could not be decoded. Every variant maps to a [`NackReason`] so the
/// aggregator can refuse a batch with a reason the shipper turns into a loss record.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// Fewer bytes than the structure's v1 size.
    #[error("{what} too short: need {need} bytes, got {got}")]
    TooShort { what: &'static str, need: usize, got: usize },
    /// The batch does not start with the envelope magic.
    #[error("bad magic {got:#010x} (want {want:#010x})", want = crate::BATCH_MAGIC)]
    BadMagic { got: u32 },
    /// A version this reader does not support.
    #[error("unsupported {what} version {got}")]
    UnsupportedVersion { what: &'static str, got: u16 },
    /// A declared length disagrees with the bytes present.
    #[error("{what} length mismatch: declared {declared}, actual {actual}")]
    LengthMismatch { what: &'static str, declared: usize, actual: usize },
    /// A frame's `length` is below the header size or not a multiple of 8.
    #[error("bad frame length {length} at payload offset {offset}")]
    BadFrameLength { offset: usize, length: u32 },
    /// The CRC32C does not match.
    #[error("checksum mismatch: envelope says {expected:#010x}, computed {computed:#010x}")]
    ChecksumMismatch { expected: u32, computed: u32 },
    /// The stream summary disagrees with the frames.
    #[error(
        "stream summary mismatch for stream {stream_id:#010x}: {field} is {summary} in the summary, {frames} in the frames"
    )]
    SummaryMismatch { stream_id: u32, field: &'static str, summary: u64, frames: u64 },
    /// A frame's class differs from the batch's lane.
    #[error("frame at payload offset {offset} has class {class}, batch lane is {lane}")]
    LaneMismatch { offset: usize, class: u8, lane: u8 },
    /// A section with another tag where a specific one was required.
    #[error("expected section tag {expected}, got {got}")]
    UnexpectedSection { expected: u16, got: u16 },
    /// Larger than the reader accepts from a peer.
    #[error("{what} too large: {got} bytes, limit {limit}")]
    TooLarge { what: &'static str, got: usize, limit: usize },
}

impl DecodeError {
    /// The nack reason the aggregator sends for this error.
    #[must_use]
    pub fn nack_reason(&self) -> NackReason {
        match self {
            Self::TooShort { .. } => NackReason::TooShort,
            Self::BadMagic { .. } => NackReason::BadMagic,
            Self::UnsupportedVersion { .. } => NackReason::UnsupportedVersion,
            Self::LengthMismatch { .. } => NackReason::LengthMismatch,
            Self::BadFrameLength { .. } | Self::UnexpectedSection { .. } => NackReason::MalformedFrame,
            Self::ChecksumMismatch { .. } => NackReason::ChecksumMismatch,
            Self::SummaryMismatch { .. } => NackReason::SummaryMismatch,
            Self::LaneMismatch { .. } => NackReason::LaneMismatch,
            Self::TooLarge { .. } => NackReason::TooLarge,
        }
    }

    /// A short stable label for metrics (`reason` label; bounded).
    #[must_use]
    pub fn label(&self) -> &'static str {
        match self {
            Self::TooShort { .. } => "too_short",
            Self::BadMagic { .. } => "bad_magic",
            Self::UnsupportedVersion { .. } => "unsupported_version",
            Self::LengthMismatch { .. } => "length_mismatch",
            Self::BadFrameLength { .. } => "bad_frame_length",
            Self::ChecksumMismatch { .. } => "checksum_mismatch",
            Self::SummaryMismatch { .. } => "summary_mismatch",
            Self::LaneMismatch { .. } => "lane_mismatch",
            Self::UnexpectedSection { .. } => "unexpected_section",
            Self::TooLarge { .. } => "too_large",
        }
    }
}
