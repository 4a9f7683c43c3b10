//! Control messages, aggregator → shipper, on the connection's control stream.
//!
//! Each message is an 8-byte [`ControlHeader`] `{msg_type, length}` and a body; `length`
//! counts the whole message. Messages of unknown type are skipped by length. A length
//! over [`MAX_CONTROL_LEN`] is refused (`TooLarge`) so a hostile peer cannot make the
//! shipper buffer without bound.

use zerocopy::little_endian::{U16, U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::codes::{AckStatus, ControlType, NackReason, WireEnum};
use crate::error::DecodeError;

/// The largest control message a reader accepts (an ack of 4,094 ranges).
pub const MAX_CONTROL_LEN: usize = 64 * 1024;

/// Leads every control message (8 B).
#[repr(C)]
#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned, Clone, Copy, Debug, PartialEq, Eq)]
pub struct ControlHeader {
    /// [`ControlType`] code.
    pub msg_type: U16,
    pub _reserved0: [u8; 2],
    /// Whole message length, header included.
    pub length: U32,
}
const _: () = assert!(size_of::<ControlHeader>() == 8);

/// `hello` body: which aggregator instance the shipper is talking to (16 B).
#[repr(C)]
#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned, Clone, Copy, Debug, PartialEq, Eq)]
pub struct HelloBody {
    /// Random per aggregator process.
    pub aggregator_instance: U64,
    /// Increases on every aggregator restart (restored from its snapshot).
    pub aggregator_epoch: U64,
}
const _: () = assert!(size_of::<HelloBody>() == 16);

/// `ack` head, followed by `range_count` [`AckRange`]s (16 B).
#[repr(C)]
#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned, Clone, Copy, Debug, PartialEq, Eq)]
pub struct AckHead {
    pub shipper_session: U64,
    pub range_count: U32,
    /// [`AckStatus`] code.
    pub status: u8,
    pub _reserved0: [u8; 3],
}
const _: () = assert!(size_of::<AckHead>() == 16);

/// An inclusive range of acknowledged `batch_seq`s (16 B).
#[repr(C)]
#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned, Clone, Copy, Debug, PartialEq, Eq)]
pub struct AckRange {
    pub first: U64,
    pub last: U64,
}
const _: () = assert!(size_of::<AckRange>() == 16);

/// `nack` body (24 B).
#[repr(C)]
#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned, Clone, Copy, Debug, PartialEq, Eq)]
pub struct NackBody {
    pub shipper_session: U64,
    pub batch_seq: U64,
    /// [`NackReason`] code.
    pub reason: U16,
    pub _reserved0: [u8; 6],
}
const _: () = assert!(size_of::<NackBody>() == 24);

/// A decoded control message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ControlMessage<'a> {
    Hello {
        aggregator_instance: u64,
        aggregator_epoch: u64,
    },
    Ack {
        shipper_session: u64,
        status: AckStatus,
        ranges: &'a [AckRange],
    },
    Nack {
        shipper_session: u64,
        batch_seq: u64,
        reason: NackReason,
    },
    /// A type this version does not know; skipped.
    Unknown {
        msg_type: u16,
        length: usize,
    },
}

fn body<T: FromBytes + KnownLayout + Immutable + Unaligned>(
    body: &[u8],
    what: &'static str,
) -> Result<(T, usize), DecodeError> {
    T::read_from_prefix(body).map(|(v, rest)| (v, body.len() - rest.len())).map_err(|_| DecodeError::TooShort {
        what,
        need: size_of::<T>(),
        got: body.len(),
    })
}

/// Parses the message at the front of `bytes`. `Ok(None)` means more bytes are needed;
/// otherwise returns the message and how many bytes it used.
pub fn parse_control(bytes: &[u8]) -> Result<Option<(ControlMessage<'_>, usize)>, DecodeError> {
    let Ok((header, _)) = ControlHeader::read_from_prefix(bytes) else {
        return Ok(None);
    };
    let length = usize::try_from(header.length.get()).unwrap_or(usize::MAX);
    if length > MAX_CONTROL_LEN {
        return Err(DecodeError::TooLarge { what: "control message", got: length, limit: MAX_CONTROL_LEN });
    }
    if length < size_of::<ControlHeader>() {
        return Err(DecodeError::TooShort { what: "control message", need: size_of::<ControlHeader>(), got: length });
    }
    let Some(msg) = bytes.get(..length) else {
        return Ok(None);
    };
    let payload = msg.get(size_of::<ControlHeader>()..).unwrap_or(&[]);
    let message = match ControlType::from_code(header.msg_type.get()) {
        ControlType::Hello => {
            let (b, _) = body::<HelloBody>(payload, "hello")?;
            ControlMessage::Hello {
                aggregator_instance: b.aggregator_instance.get(),
                aggregator_epoch: b.aggregator_epoch.get(),
            }
        }
        ControlType::Ack => {
            let (head, used) = body::<AckHead>(payload, "ack")?;
            let rest = payload.get(used..).unwrap_or(&[]);
            let count = usize::try_from(head.range_count.get()).unwrap_or(usize::MAX);
            let (ranges, _) =
                <[AckRange]>::ref_from_prefix_with_elems(rest, count).map_err(|_| DecodeError::LengthMismatch {
                    what: "ack ranges",
                    declared: count.saturating_mul(size_of::<AckRange>()),
                    actual: rest.len(),
                })?;
            ControlMessage::Ack {
                shipper_session: head.shipper_session.get(),
                status: AckStatus::from_code(head.status),
                ranges,
            }
        }
        ControlType::Nack => {
            let (b, _) = body::<NackBody>(payload, "nack")?;
            ControlMessage::Nack {
                shipper_session: b.shipper_session.get(),
                batch_seq: b.batch_seq.get(),
                reason: NackReason::from_code(b.reason.get()),
            }
        }
        ControlType::Unrecognized(msg_type) => ControlMessage::Unknown { msg_type, length },
    };
    Ok(Some((message, length)))
}

#[cfg(feature = "alloc")]
mod encode {
    use alloc::vec::Vec;

    use super::*;

    fn header(out: &mut Vec<u8>, ty: ControlType, body_len: usize) {
        // Control messages are capped at MAX_CONTROL_LEN (64 KiB), far below u32::MAX.
        let length = u32::try_from(size_of::<ControlHeader>() + body_len).unwrap_or(u32::MAX);
        let h = ControlHeader { msg_type: U16::new(ty.code()), _reserved0: [0; 2], length: U32::new(length) };
        out.extend_from_slice(h.as_bytes());
    }

    /// Appends a `hello`.
    pub fn encode_hello(out: &mut Vec<u8>, aggregator_instance: u64, aggregator_epoch: u64) {
        header(out, ControlType::Hello, size_of::<HelloBody>());
        let b = HelloBody {
            aggregator_instance: U64::new(aggregator_instance),
            aggregator_epoch: U64::new(aggregator_epoch),
        };
        out.extend_from_slice(b.as_bytes());
    }

    /// Appends an `ack` of inclusive `batch_seq` ranges.
    pub fn encode_ack(
        out: &mut Vec<u8>,
        shipper_session: u64,
        status: AckStatus,
        ranges: &[(u64, u64)],
    ) -> Result<(), DecodeError> {
        let body_len = size_of::<AckHead>() + ranges.len() * size_of::<AckRange>();
        if size_of::<ControlHeader>() + body_len > MAX_CONTROL_LEN {
            return Err(DecodeError::TooLarge {
                what: "control message",
                got: size_of::<ControlHeader>() + body_len,
                limit: MAX_CONTROL_LEN,
            });
        }
        header(out, ControlType::Ack, body_len);
        let head = AckHead {
            shipper_session: U64::new(shipper_session),
            range_count: U32::new(u32::try_from(ranges.len()).unwrap_or(u32::MAX)),
            status: status.code(),
            _reserved0: [0; 3],
        };
        out.extend_from_slice(head.as_bytes());
        for &(first, last) in ranges {
            out.extend_from_slice(AckRange { first: U64::new(first), last: U64::new(last) }.as_bytes());
        }
        Ok(())
    }

    /// Appends a `nack`.
    pub fn encode_nack(out: &mut Vec<u8>, shipper_session: u64, batch_seq: u64, reason: NackReason) {
        header(out, ControlType::Nack, size_of::<NackBody>());
        let b = NackBody {
            shipper_session: U64::new(shipper_session),
            batch_seq: U64::new(batch_seq),
            reason: U16::new(reason.code()),
            _reserved0: [0; 6],
        };
        out.extend_from_slice(b.as_bytes());
    }
}

#[cfg(feature = "alloc")]
pub use encode::{encode_ack, encode_hello, encode_nack};

#[cfg(all(test, feature = "alloc"))]
mod tests {
    use alloc::vec::Vec;

    use super::*;

    #[test]
    fn messages_round_trip_and_stream_in_pieces() {
        let mut out = Vec::new();
        encode_hello(&mut out, 7, 3);
        encode_ack(&mut out, 9, AckStatus::Applied, &[(1, 4), (6, 6)]).unwrap();
        encode_nack(&mut out, 9, 5, NackReason::ChecksumMismatch);
        // An unknown type in between is skipped by length.
        out.extend_from_slice(&[0xee, 0x7f, 0, 0, 16, 0, 0, 0]);
        out.extend_from_slice(&[0xab; 8]);

        // Every strict prefix is "need more", never an error.
        for cut in 0..8 {
            assert_eq!(parse_control(&out[..cut]), Ok(None));
        }
        let mut rest = &out[..];
        let mut got = Vec::new();
        while let Some((msg, used)) = parse_control(rest).unwrap() {
            got.push(msg);
            rest = &rest[used..];
        }
        assert!(rest.is_empty());
        assert_eq!(got[0], ControlMessage::Hello { aggregator_instance: 7, aggregator_epoch: 3 });
        match got[1] {
            ControlMessage::Ack { shipper_session: 9, status: AckStatus::Applied, ranges } => {
                assert_eq!(ranges.len(), 2);
                assert_eq!((ranges[1].first.get(), ranges[1].last.get()), (6, 6));
            }
            other => panic!("unexpected {other:?}"),
        }
        assert_eq!(
            got[2],
            ControlMessage::Nack { shipper_session: 9, batch_seq: 5, reason: NackReason::ChecksumMismatch }
        );
        assert_eq!(got[3], ControlMessage::Unknown { msg_type: 0x7fee, length: 16 });
    }

    #[test]
    fn hostile_lengths_are_refused() {
        let huge = [2u8, 0, 0, 0, 0xff, 0xff, 0xff, 0x7f];
        assert!(matches!(parse_control(&huge), Err(DecodeError::TooLarge { .. })));
        let tiny = [2u8, 0, 0, 0, 4, 0, 0, 0];
        assert!(matches!(parse_control(&tiny), Err(DecodeError::TooShort { .. })));
        // An ack claiming more ranges than its length holds.
        let mut out = Vec::new();
        encode_ack(&mut out, 1, AckStatus::Durable, &[(1, 1)]).unwrap();
        out[16] = 5; // range_count
        assert!(matches!(parse_control(&out), Err(DecodeError::LengthMismatch { .. })));
    }
}
