//! Control messages on the connection's control stream: `hello`, `ack`, `nack`
//! (aggregator → shipper) and `resume` (shipper → aggregator, once, right after the
//! control preface).
//!
//! Each message is an 8-byte [`ControlHeader`] `{msg_type, length}` and a body; `length`
//! counts the whole message. Messages of unknown type are skipped by length. A length
//! over [`MAX_CONTROL_LEN`] is refused (`TooLarge`) so a hostile peer cannot make either
//! side buffer without bound.

use zerocopy::little_endian::{U16, U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::codes::{AckStatus, ControlType, Durability, NackReason, WireEnum};
use crate::error::DecodeError;

/// The largest control message a reader accepts: a `resume` with
/// [`MAX_RESUME_RANGES`] held ranges and [`MAX_RESUME_STREAMS`] stream floors fits.
pub const MAX_CONTROL_LEN: usize = 256 * 1024;

/// Held `batch_seq` ranges one `resume` may list (the lowest ones; see [`ResumeHead`]).
pub const MAX_RESUME_RANGES: usize = 8192;

/// Stream floors one `resume` may list (2 rings × 256 CPUs and the shipper's own
/// streams fit many times over).
pub const MAX_RESUME_STREAMS: usize = 4096;

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

/// The control protocol this build speaks best (the digit of the preface `RWCTL3\0\0`):
/// 3 adds the `hello` extension ([`HelloExt`]: the negotiated version and the
/// aggregator's durability) and `ack durable`.
pub const CONTROL_VERSION: u16 = 3;
/// The oldest control protocol this build still speaks (one version back, so a rolling
/// upgrade of either side keeps working): 2, whose `hello` is [`HelloBody`] alone and
/// whose acks all mean applied.
pub const MIN_CONTROL_VERSION: u16 = 2;

/// The 8-byte control-stream preface of protocol `version` (`RWCTL<digit>\0\0`).
#[must_use]
pub fn control_preface(version: u16) -> [u8; 8] {
    let digit = u8::try_from(version % 10).unwrap_or(0);
    [b'R', b'W', b'C', b'T', b'L', b'0' + digit, 0, 0]
}

/// The control protocol a preface names, if it is one (any digit; the caller decides
/// whether it speaks it).
#[must_use]
pub fn preface_version(preface: &[u8; 8]) -> Option<u16> {
    match preface {
        [b'R', b'W', b'C', b'T', b'L', d @ b'0'..=b'9', 0, 0] => Some(u16::from(d - b'0')),
        _ => None,
    }
}

/// `hello` body: which aggregator instance the shipper is talking to (16 B). From
/// protocol 3 on, a [`HelloExt`] follows it; a protocol-2 reader reads the prefix.
#[repr(C)]
#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned, Clone, Copy, Debug, PartialEq, Eq)]
pub struct HelloBody {
    /// Random per aggregator process.
    pub aggregator_instance: U64,
    /// Increases on every aggregator restart (restored from its snapshot).
    pub aggregator_epoch: U64,
}
const _: () = assert!(size_of::<HelloBody>() == 16);

/// Protocol 3's extension of `hello` (8 B): what the connection speaks and what an ack
/// promises.
#[repr(C)]
#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned, Clone, Copy, Debug, PartialEq, Eq)]
pub struct HelloExt {
    /// The control protocol of this connection: the lower of the two sides' best.
    pub control_version: U16,
    /// [`Durability`] code: what the aggregator keeps across a crash.
    pub durability: u8,
    pub _reserved0: [u8; 5],
}
const _: () = assert!(size_of::<HelloExt>() == 8);

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

/// `resume` head (40 B), followed by `range_count` [`AckRange`]s (the `batch_seq`s the
/// shipper still holds and will send again, ascending, inclusive) and `stream_count`
/// [`ResumeStream`]s.
///
/// Meaning: every `batch_seq` of the session below `next_batch_seq` that is not in a held
/// range was acked by an aggregator instance (or reported lost in a loss record) and will
/// never be sent again; the aggregator settles them, so no restart can leave the session
/// refused. If the shipper holds more ranges than fit, it lists the lowest and sets
/// `next_batch_seq` to the first one it left out.
#[repr(C)]
#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned, Clone, Copy, Debug, PartialEq, Eq)]
pub struct ResumeHead {
    pub shipper_session: U64,
    /// The kernel-counter epoch the stream floors belong to.
    pub epoch: U64,
    /// One past the highest `batch_seq` the resume speaks for.
    pub next_batch_seq: U64,
    pub range_count: U32,
    pub stream_count: U32,
    /// The node's monotonic clock (the time base of its frames) when the shipper wrote
    /// this `resume`: a fresh clock sample at connection time (0: none). Heartbeats
    /// written before it may have waited in the spool, so the aggregator does not take
    /// their send times as clock samples.
    pub sent_ns: U64,
}
const _: () = assert!(size_of::<ResumeHead>() == 40);

/// One stream's floor in a `resume` (16 B): every seq below `floor_seq` was delivered to
/// (or declared lost to) an aggregator instance in a batch that will not be sent again,
/// was still held (and is sent again), or was dropped by the kernel. An instance that
/// never saw them counts the ones it cannot otherwise explain as `prior_instance`, not
/// loss.
#[repr(C)]
#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned, Clone, Copy, Debug, PartialEq, Eq)]
pub struct ResumeStream {
    pub stream_id: U32,
    pub _reserved0: [u8; 4],
    pub floor_seq: U64,
}
const _: () = assert!(size_of::<ResumeStream>() == 16);

/// A decoded control message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ControlMessage<'a> {
    Hello {
        aggregator_instance: u64,
        aggregator_epoch: u64,
        /// The connection's control protocol (2 when the `hello` has no extension).
        control_version: u16,
        /// What the aggregator keeps across a crash (`none` for protocol 2).
        durability: Durability,
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
    Resume {
        shipper_session: u64,
        epoch: u64,
        next_batch_seq: u64,
        sent_ns: u64,
        held: &'a [AckRange],
        streams: &'a [ResumeStream],
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
            let (b, used) = body::<HelloBody>(payload, "hello")?;
            let ext = payload.get(used..).and_then(|rest| HelloExt::read_from_prefix(rest).ok()).map(|(e, _)| e);
            ControlMessage::Hello {
                aggregator_instance: b.aggregator_instance.get(),
                aggregator_epoch: b.aggregator_epoch.get(),
                control_version: ext.map_or(MIN_CONTROL_VERSION, |e| e.control_version.get()),
                durability: ext.map_or(Durability::None, |e| Durability::from_code(e.durability)),
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
        ControlType::Resume => {
            let (head, used) = body::<ResumeHead>(payload, "resume")?;
            let rest = payload.get(used..).unwrap_or(&[]);
            let ranges = usize::try_from(head.range_count.get()).unwrap_or(usize::MAX);
            let streams = usize::try_from(head.stream_count.get()).unwrap_or(usize::MAX);
            if ranges > MAX_RESUME_RANGES {
                return Err(DecodeError::TooLarge { what: "resume ranges", got: ranges, limit: MAX_RESUME_RANGES });
            }
            if streams > MAX_RESUME_STREAMS {
                return Err(DecodeError::TooLarge { what: "resume streams", got: streams, limit: MAX_RESUME_STREAMS });
            }
            let declared = ranges * size_of::<AckRange>() + streams * size_of::<ResumeStream>();
            let mismatch = || DecodeError::LengthMismatch { what: "resume body", declared, actual: rest.len() };
            let (held, rest) = <[AckRange]>::ref_from_prefix_with_elems(rest, ranges).map_err(|_| mismatch())?;
            let (streams, _) = <[ResumeStream]>::ref_from_prefix_with_elems(rest, streams).map_err(|_| mismatch())?;
            ControlMessage::Resume {
                shipper_session: head.shipper_session.get(),
                epoch: head.epoch.get(),
                next_batch_seq: head.next_batch_seq.get(),
                sent_ns: head.sent_ns.get(),
                held,
                streams,
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

    /// Appends a `hello` for a connection of control protocol `control_version`: the
    /// protocol-2 body alone below 3, with the [`HelloExt`] from 3 on.
    pub fn encode_hello(
        out: &mut Vec<u8>,
        aggregator_instance: u64,
        aggregator_epoch: u64,
        control_version: u16,
        durability: Durability,
    ) {
        let ext = control_version >= 3;
        let len = size_of::<HelloBody>() + if ext { size_of::<HelloExt>() } else { 0 };
        header(out, ControlType::Hello, len);
        let b = HelloBody {
            aggregator_instance: U64::new(aggregator_instance),
            aggregator_epoch: U64::new(aggregator_epoch),
        };
        out.extend_from_slice(b.as_bytes());
        if ext {
            let e = HelloExt {
                control_version: U16::new(control_version),
                durability: durability.code(),
                _reserved0: [0; 5],
            };
            out.extend_from_slice(e.as_bytes());
        }
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

    /// Appends a `resume`: `held` are inclusive `batch_seq` ranges, ascending; `streams`
    /// are `(stream_id, floor_seq)`; `sent_ns` is the node's monotonic clock now (see
    /// [`ResumeHead::sent_ns`]). Errors if either list is over its cap.
    pub fn encode_resume(
        out: &mut Vec<u8>,
        shipper_session: u64,
        epoch: u64,
        next_batch_seq: u64,
        sent_ns: u64,
        held: &[(u64, u64)],
        streams: &[(u32, u64)],
    ) -> Result<(), DecodeError> {
        if held.len() > MAX_RESUME_RANGES {
            return Err(DecodeError::TooLarge { what: "resume ranges", got: held.len(), limit: MAX_RESUME_RANGES });
        }
        if streams.len() > MAX_RESUME_STREAMS {
            return Err(DecodeError::TooLarge {
                what: "resume streams",
                got: streams.len(),
                limit: MAX_RESUME_STREAMS,
            });
        }
        let body_len =
            size_of::<ResumeHead>() + held.len() * size_of::<AckRange>() + streams.len() * size_of::<ResumeStream>();
        header(out, ControlType::Resume, body_len);
        let head = ResumeHead {
            shipper_session: U64::new(shipper_session),
            epoch: U64::new(epoch),
            next_batch_seq: U64::new(next_batch_seq),
            // Both bounded by the caps checked above.
            range_count: U32::new(u32::try_from(held.len()).unwrap_or(u32::MAX)),
            stream_count: U32::new(u32::try_from(streams.len()).unwrap_or(u32::MAX)),
            sent_ns: U64::new(sent_ns),
        };
        out.extend_from_slice(head.as_bytes());
        for &(first, last) in held {
            out.extend_from_slice(AckRange { first: U64::new(first), last: U64::new(last) }.as_bytes());
        }
        for &(stream_id, floor) in streams {
            let s = ResumeStream { stream_id: U32::new(stream_id), _reserved0: [0; 4], floor_seq: U64::new(floor) };
            out.extend_from_slice(s.as_bytes());
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
pub use encode::{encode_ack, encode_hello, encode_nack, encode_resume};

#[cfg(all(test, feature = "alloc"))]
mod tests {
    use alloc::vec::Vec;

    use super::*;

    #[test]
    fn messages_round_trip_and_stream_in_pieces() {
        let mut out = Vec::new();
        encode_hello(&mut out, 7, 3, CONTROL_VERSION, Durability::Snapshot);
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
        assert_eq!(
            got[0],
            ControlMessage::Hello {
                aggregator_instance: 7,
                aggregator_epoch: 3,
                control_version: 3,
                durability: Durability::Snapshot
            }
        );
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

    /// A protocol-2 `hello` is the 16-byte body alone: read as protocol 2 without
    /// durability; a protocol-3 one read by a protocol-2 reader is the same prefix.
    #[test]
    fn hello_of_protocol_2_reads_as_none_and_prefaces_round_trip() {
        let mut v2 = Vec::new();
        encode_hello(&mut v2, 7, 3, 2, Durability::Snapshot);
        assert_eq!(v2.len(), 8 + 16);
        let (msg, _) = parse_control(&v2).unwrap().unwrap();
        assert_eq!(
            msg,
            ControlMessage::Hello {
                aggregator_instance: 7,
                aggregator_epoch: 3,
                control_version: 2,
                durability: Durability::None
            }
        );
        let mut v3 = Vec::new();
        encode_hello(&mut v3, 7, 3, 3, Durability::Snapshot);
        assert_eq!(v3.len(), 8 + 24);
        assert_eq!(&v3[8..24], &v2[8..24], "protocol 2's body is protocol 3's prefix");
        for v in [2, 3] {
            assert_eq!(preface_version(&control_preface(v)), Some(v));
        }
        assert_eq!(&control_preface(2), b"RWCTL2\0\0");
        assert_eq!(preface_version(b"RWCTLx\0\0"), None);
        assert_eq!(preface_version(b"GET / HT"), None);
    }

    #[test]
    fn resume_round_trips_and_refuses_hostile_counts() {
        let mut out = Vec::new();
        encode_resume(&mut out, 9, 2, 40, 1234, &[(3, 5), (9, 9)], &[(0x0201_0000, 77)]).unwrap();
        let (msg, used) = parse_control(&out).unwrap().unwrap();
        assert_eq!(used, out.len());
        match msg {
            ControlMessage::Resume {
                shipper_session: 9,
                epoch: 2,
                next_batch_seq: 40,
                sent_ns: 1234,
                held,
                streams,
            } => {
                assert_eq!(held.len(), 2);
                assert_eq!((held[1].first.get(), held[1].last.get()), (9, 9));
                assert_eq!((streams[0].stream_id.get(), streams[0].floor_seq.get()), (0x0201_0000, 77));
            }
            other => panic!("unexpected {other:?}"),
        }
        // A count larger than the body: a length mismatch, never a read past the end.
        let mut bad = out.clone();
        bad[8 + 28] = 3; // stream_count
        assert!(matches!(parse_control(&bad), Err(DecodeError::LengthMismatch { .. })));
        // Counts over the caps are refused before any arithmetic on them.
        let mut huge = out.clone();
        huge[8 + 24..8 + 28].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(parse_control(&huge), Err(DecodeError::TooLarge { .. })));
        let too_many = alloc::vec![(1u64, 1u64); MAX_RESUME_RANGES + 1];
        assert!(encode_resume(&mut Vec::new(), 1, 1, 1, 0, &too_many, &[]).is_err());
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
