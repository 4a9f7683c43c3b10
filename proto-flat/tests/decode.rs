//! Round trips (proptest) and the malformed corpus: every malformation gets its own
//! error, and no input makes a decoder panic.

use proptest::prelude::*;
use proto_flat::batch::{BatchView, BatchWriter, MAX_BATCH_BYTES, SummaryCheck, decode_batch, reseal};
use proto_flat::codes::{Class, FrameKind, LossCause, Phase, WireEnum};
use proto_flat::control::parse_control;
use proto_flat::decode::{Frame, FrameIter};
use proto_flat::frames::{BulkPacketFrame, CollectiveFrame, FixedFrame, LossRecordFrame, P2pFrame};
use proto_flat::header::{FrameHeader, StreamId};
use proto_flat::sample;
use proto_flat::sections::{Section, StreamEntry};
use proto_flat::{DecodeError, encode::SectionedFrameWriter};
use zerocopy::little_endian::{U16, U32, U64};
use zerocopy::{FromBytes, FromZeros, IntoBytes};

const HEADER_LEN: usize = 152;

fn p0_batch() -> Vec<u8> {
    sample::batch(Class::P0, 1, &sample::frames_for_lane(Class::P0, 10)).unwrap()
}

fn p1_batch() -> Vec<u8> {
    sample::batch(Class::P1, 2, &sample::frames_for_lane(Class::P1, 0)).unwrap()
}

fn summary_at(b: &[u8]) -> usize {
    let payload_len = u32::from_le_bytes(b[44..48].try_into().unwrap()) as usize;
    HEADER_LEN + payload_len
}

fn err(b: &[u8]) -> DecodeError {
    decode_batch(b).expect_err("malformed batch must not decode")
}

// ---------------------------------------------------------------- round trips

#[test]
fn every_sample_lane_round_trips() {
    for lane in [Class::P0, Class::P1, Class::P2] {
        let frames = sample::frames_for_lane(lane, 5);
        let bytes = sample::batch(lane, 9, &frames).unwrap();
        let view = decode_batch(&bytes).unwrap();
        assert_eq!(view.lane(), lane);
        assert_eq!(view.header.batch_seq.get(), 9);
        assert_eq!(view.header.frame_count.get() as usize, frames.len());
        let decoded: Vec<Frame<'_>> = view.frames().collect::<Result<_, _>>().unwrap();
        assert_eq!(decoded.len(), frames.len());
        for (d, f) in decoded.iter().zip(&frames) {
            assert_eq!(d.header().as_bytes(), &f[..32]);
            assert!(!matches!(d, Frame::Unknown { .. }), "{lane}: {d:?}");
        }
    }
}

#[test]
fn heartbeat_sections_read_back() {
    let hb = sample::heartbeat(1, 5_000, StreamId::new(Class::P0, 0, 2), 77);
    let mut it = FrameIter::new(&hb);
    let Some(Ok(Frame::Heartbeat(h))) = it.next() else { panic!("not a heartbeat") };
    let tags: Vec<_> = h
        .sections()
        .map(|s| match s {
            Section::Streams(e) => {
                let e = e.iter().next().unwrap();
                assert_eq!(e.attempted_seq.get(), 77);
                assert_eq!(e.drops_for(LossCause::KernelRingFull), 3);
                assert_eq!(e.stream(), StreamId::new(Class::P0, 0, 2));
                "streams"
            }
            Section::Progress(p) => {
                assert_eq!(p.iter().next().unwrap().last_completed_op.get(), 10);
                "progress"
            }
            Section::ClockRealtime(_) => "clock_realtime",
            Section::ClockGpu(_) => "clock_gpu",
            Section::ShipperState(_) => "shipper_state",
            other => panic!("unexpected {other:?}"),
        })
        .collect();
    assert_eq!(tags, ["streams", "progress", "clock_realtime", "clock_gpu", "shipper_state"]);
    assert!(it.next().is_none());
}

fn arb_fixed<T: FixedFrame + Clone>(lane: Class) -> impl Strategy<Value = Vec<u8>> {
    (proptest::collection::vec(any::<u8>(), size_of::<T>()), any::<u8>(), any::<u16>(), any::<u64>(), any::<u64>())
        .prop_map(move |(body, ring, cpu, seq, ts)| {
            let mut f = T::read_from_bytes(&body).unwrap();
            let hdr = T::make_header(0, StreamId::new(lane, ring, cpu), seq, ts);
            f.as_mut_bytes()[..32].copy_from_slice(hdr.as_bytes());
            f.as_bytes().to_vec()
        })
}

fn arb_p0_frame() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![arb_fixed::<CollectiveFrame>(Class::P0), arb_fixed::<P2pFrame>(Class::P0)]
}

fn arb_heartbeat() -> impl Strategy<Value = Vec<u8>> {
    (proptest::collection::vec(proptest::collection::vec(any::<u8>(), 96), 0..6), any::<u64>(), any::<u64>()).prop_map(
        |(entries, seq, ts)| {
            let entries: Vec<StreamEntry> = entries.iter().map(|b| StreamEntry::read_from_bytes(b).unwrap()).collect();
            let mut w = SectionedFrameWriter::heartbeat(sample::SHIPPER_STREAM, seq, ts, ts / 2);
            w.section(&entries);
            w.finish()
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_p0_batches_round_trip(frames in proptest::collection::vec(arb_p0_frame(), 0..40), seq in 1u64..) {
        let bytes = sample::batch(Class::P0, seq, &frames).unwrap();
        let view = decode_batch(&bytes).unwrap();
        prop_assert_eq!(view.header.batch_seq.get(), seq);
        let mut n = 0;
        for (d, f) in view.frames().zip(&frames) {
            let d = d.unwrap();
            // Fixed frames decode to the very bytes that went in.
            let got = match d {
                Frame::Collective(c) => c.as_bytes(),
                Frame::P2p(p) => p.as_bytes(),
                other => panic!("unexpected {other:?}"),
            };
            prop_assert_eq!(got, &f[..]);
            n += 1;
        }
        prop_assert_eq!(n, frames.len());
        // Summary totals equal what went in, per stream.
        let total: u64 = view.summary.iter().map(|e| u64::from(e.frame_count.get())).sum();
        prop_assert_eq!(total, frames.len() as u64);
    }

    #[test]
    fn arbitrary_heartbeats_round_trip(hb in arb_heartbeat()) {
        let bytes = sample::batch(Class::P1, 1, std::slice::from_ref(&hb)).unwrap();
        let view = decode_batch(&bytes).unwrap();
        let frame = view.frames().next().unwrap().unwrap();
        let Frame::Heartbeat(h) = frame else { panic!("not a heartbeat") };
        let mut n = 0;
        for s in h.sections() {
            let Section::Streams(e) = s else { panic!("unexpected section") };
            for (i, entry) in e.iter().enumerate() {
                let at = 32 + 16 + 8 + i * 96;
                prop_assert_eq!(entry.as_bytes(), &hb[at..at + 96]);
                n += 1;
            }
        }
        prop_assert!(n <= 5);
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
        let _ = decode_batch(&bytes);
        for f in FrameIter::new(&bytes) {
            if let Ok(Frame::Heartbeat(h)) = f {
                let _ = h.sections().count();
            }
        }
        let _ = parse_control(&bytes);
    }

    #[test]
    fn mutated_batches_never_panic(idx in 0usize..4096, byte in any::<u8>(), resealed in any::<bool>()) {
        let mut b = p1_batch();
        let i = idx % b.len();
        b[i] = byte;
        if resealed { reseal(&mut b); }
        if let Ok(view) = decode_batch(&b) {
            for f in view.frames() {
                if let Ok(Frame::Heartbeat(h)) = f { let _ = h.sections().count(); }
            }
        }
    }
}

// ---------------------------------------------------------------- malformed corpus

#[test]
fn truncated_batches_error_at_every_length() {
    let b = p1_batch();
    for cut in 0..b.len() {
        let e = err(&b[..cut]);
        let ok = match cut {
            0..=3 => matches!(e, DecodeError::TooShort { what: "batch magic", .. }),
            4..=151 => matches!(e, DecodeError::TooShort { what: "batch header", .. }),
            _ if cut < summary_at(&b) => matches!(e, DecodeError::LengthMismatch { what: "batch payload", .. }),
            _ if cut < summary_at(&b) + 8 => matches!(e, DecodeError::TooShort { what: "section header", .. }),
            _ => matches!(e, DecodeError::LengthMismatch { what: "section", .. }),
        };
        assert!(ok, "cut at {cut}: {e}");
    }
}

#[test]
fn wrong_magic_version_and_header_len() {
    let mut b = p0_batch();
    b[0] ^= 0xff;
    assert!(matches!(err(&b), DecodeError::BadMagic { .. }));

    let mut b = p0_batch();
    b[4..6].copy_from_slice(&2u16.to_le_bytes());
    assert_eq!(err(&b), DecodeError::UnsupportedVersion { what: "batch", got: 2 });

    let mut b = p0_batch();
    b[6..8].copy_from_slice(&100u16.to_le_bytes());
    assert!(matches!(err(&b), DecodeError::TooShort { what: "batch header_len", need: 152, got: 100 }));
}

#[test]
fn wrong_lengths() {
    // payload_len beyond the buffer.
    let mut b = p0_batch();
    b[44..48].copy_from_slice(&(1u32 << 20).to_le_bytes());
    assert!(matches!(err(&b), DecodeError::LengthMismatch { what: "batch payload", .. }));
    // Trailing garbage after the summary.
    let mut b = p0_batch();
    b.extend_from_slice(&[0; 8]);
    assert!(matches!(err(&b), DecodeError::LengthMismatch { what: "batch", .. }));
    // frame_count disagreeing with the frames (resealed, so the checksum passes).
    let mut b = p0_batch();
    b[40..44].copy_from_slice(&99u32.to_le_bytes());
    reseal(&mut b);
    assert!(matches!(err(&b), DecodeError::LengthMismatch { what: "batch frame_count", declared: 99, actual: 3 }));
    // A frame length that is not a multiple of 8, one below the header, one past the end.
    for (len, want) in [(140u32, "bad"), (16, "bad"), (4096, "past")] {
        let mut b = p0_batch();
        b[HEADER_LEN + 8..HEADER_LEN + 12].copy_from_slice(&len.to_le_bytes());
        reseal(&mut b);
        let e = err(&b);
        match want {
            "bad" => assert_eq!(e, DecodeError::BadFrameLength { offset: 0, length: len }),
            _ => assert!(matches!(e, DecodeError::LengthMismatch { what: "frame", .. }), "{e}"),
        }
    }
    // Oversized input is refused before anything else is read.
    let huge = vec![0u8; MAX_BATCH_BYTES + 1];
    assert!(matches!(err(&huge), DecodeError::TooLarge { .. }));
}

#[test]
fn every_single_bit_flip_is_an_error() {
    let b = p0_batch();
    let s = summary_at(&b);
    // Bytes whose flip is caught by a structural check before the checksum is computed:
    // magic, version, header_len, payload_len and the summary's section header.
    let structural = |byte: usize| byte < 8 || (44..48).contains(&byte) || (s..s + 8).contains(&byte);
    for bit in 0..b.len() * 8 {
        let mut m = b.clone();
        m[bit / 8] ^= 1 << (bit % 8);
        let e = err(&m);
        if !structural(bit / 8) {
            assert!(matches!(e, DecodeError::ChecksumMismatch { .. }), "bit {bit}: {e}");
        }
    }
}

#[test]
fn summary_disagreeing_with_frames() {
    let b = p0_batch();
    let s = summary_at(&b) + 8; // first summary entry
    // [stream_id 0..4, frame_count 4..8, first_seq 8..16, last_seq 16..24, first_ts 24..32, last_ts 32..40]
    let cases: [(usize, usize, u64, &str); 5] = [
        (4, 4, 2, "frame_count"),
        (8, 8, 11, "first_seq"),
        (16, 8, 99, "last_seq"),
        (24, 8, 1, "first_ts"),
        (32, 8, 1, "last_ts"),
    ];
    for (at, width, value, field) in cases {
        let mut m = b.clone();
        m[s + at..s + at + width].copy_from_slice(&value.to_le_bytes()[..width]);
        reseal(&mut m);
        match err(&m) {
            DecodeError::SummaryMismatch { field: f, summary, .. } => {
                assert_eq!((f, summary), (field, value));
            }
            other => panic!("{field}: {other}"),
        }
    }
    // A frame whose stream is not in the summary.
    let mut m = b.clone();
    m[s..s + 4].copy_from_slice(&StreamId::new(Class::P0, 9, 9).0.to_le_bytes());
    reseal(&mut m);
    assert!(matches!(err(&m), DecodeError::SummaryMismatch { field: "frame_count", summary: 0, .. }));
    // The summary section under another tag.
    let mut m = b;
    let t = summary_at(&m);
    m[t..t + 2].copy_from_slice(&1u16.to_le_bytes());
    reseal(&mut m);
    assert_eq!(err(&m), DecodeError::UnexpectedSection { expected: 7, got: 1 });
}

#[test]
fn summary_entry_len_below_v1_is_too_short() {
    let mut b = p0_batch();
    let t = summary_at(&b);
    b[t + 2..t + 4].copy_from_slice(&32u16.to_le_bytes());
    reseal(&mut b);
    assert_eq!(err(&b), DecodeError::TooShort { what: "section entry", need: 40, got: 32 });
}

#[test]
fn lane_mismatch_is_refused_by_reader_and_writer() {
    // Writer: a P2 frame into a P0 batch.
    let bulk = sample::bulk_packet(StreamId::new(Class::P2, 1, 0), 0, 1);
    let mut w = BatchWriter::default();
    w.begin(&proto_flat::batch::BatchMeta { lane: Class::P0.code(), ..Default::default() });
    assert!(matches!(w.push_frame(bulk.as_bytes()), Err(DecodeError::LaneMismatch { class: 2, lane: 0, .. })));
    // Reader: relabel a P0 batch as P2.
    let mut b = p0_batch();
    b[52] = Class::P2.code();
    reseal(&mut b);
    assert_eq!(err(&b), DecodeError::LaneMismatch { offset: 0, class: 0, lane: 2 });
}

fn heartbeat_with_entry_len(entry_len: u16) -> Vec<u8> {
    let mut hb = sample::heartbeat(0, 100, StreamId::new(Class::P0, 0, 0), 5);
    // First section header sits after the frame header (32) and the head (16).
    hb[48 + 2..48 + 4].copy_from_slice(&entry_len.to_le_bytes());
    hb
}

fn malformed(frame: Frame<'_>) -> DecodeError {
    match frame {
        Frame::Malformed { error, .. } => error,
        other => panic!("expected a malformed frame, got {other:?}"),
    }
}

#[test]
fn heartbeat_entry_len_below_v1_is_too_short() {
    let hb = heartbeat_with_entry_len(64);
    let e = malformed(FrameIter::new(&hb).next().unwrap().unwrap());
    assert_eq!(e, DecodeError::TooShort { what: "section entry", need: 96, got: 64 });
    // Inside a batch the bad frame is reported with its header, and its neighbours
    // still decode: one bad frame never costs the others.
    let good = sample::loss_record(9, 10, StreamId::new(Class::P2, 1, 0), 1, 2, LossCause::PsiShed);
    let b = sample::batch(Class::P1, 1, &[hb, good.as_bytes().to_vec()]).unwrap();
    let view = decode_batch(&b).unwrap();
    let mut it = view.frames();
    let first = it.next().unwrap().unwrap();
    assert_eq!(first.header().seq.get(), 0);
    assert_eq!(malformed(first), DecodeError::TooShort { what: "section entry", need: 96, got: 64 });
    assert!(matches!(it.next(), Some(Ok(Frame::LossRecord(_)))));
    assert!(it.next().is_none());
    assert_eq!(it.skipped().malformed, 1);
}

#[test]
fn heartbeat_sections_past_the_frame_are_refused() {
    let mut hb = sample::heartbeat(0, 100, StreamId::new(Class::P0, 0, 0), 5);
    hb[48 + 4..48 + 8].copy_from_slice(&1000u32.to_le_bytes()); // count
    let e = malformed(FrameIter::new(&hb).next().unwrap().unwrap());
    assert!(matches!(e, DecodeError::LengthMismatch { what: "section", .. }), "{e}");
    // A head_len below v1's and one past the frame.
    for (head_len, ok) in [(8u32, false), (4000, false)] {
        let mut hb = sample::heartbeat(0, 100, StreamId::new(Class::P0, 0, 0), 5);
        hb[32..36].copy_from_slice(&head_len.to_le_bytes());
        let f = FrameIter::new(&hb).next().unwrap().unwrap();
        assert_eq!(!matches!(f, Frame::Malformed { .. }), ok);
    }
}

#[test]
fn unknown_kinds_tags_and_versions_are_skipped_and_counted() {
    let mut unknown = vec![0u8; 40];
    unknown[..32].copy_from_slice(
        FrameHeader::new(FrameKind::Unrecognized(77), 0, 40, StreamId::new(Class::P0, 0, 1), 5, 9).as_bytes(),
    );
    let mut v2 = sample::collective(StreamId::new(Class::P0, 0, 1), 6, 10, 1, Phase::KernelEnd);
    v2.hdr.version = U16::new(2);
    let frames = vec![unknown, v2.as_bytes().to_vec()];
    let b = sample::batch(Class::P0, 1, &frames).unwrap();
    let view = decode_batch(&b).unwrap();
    let mut it = view.frames();
    let all: Vec<_> = it.by_ref().map(Result::unwrap).collect();
    assert_eq!(all.len(), 2);
    // Both still expose their header (stream + seq) for accounting.
    assert_eq!(all[0].header().seq.get(), 5);
    assert_eq!(all[1].header().seq.get(), 6);
    assert!(all.iter().all(|f| matches!(f, Frame::Unknown { .. })));
    let skipped = it.skipped();
    assert_eq!((skipped.unknown_kind, skipped.unsupported_version), (1, 1));

    // An unknown section tag inside a heartbeat is skipped, the rest still read.
    let mut hb = sample::heartbeat(0, 100, StreamId::new(Class::P0, 0, 0), 5);
    hb[48..50].copy_from_slice(&900u16.to_le_bytes());
    let Some(Ok(Frame::Heartbeat(h))) = FrameIter::new(&hb).next() else { panic!() };
    let first = h.sections().next().unwrap();
    assert!(matches!(first, Section::Unknown { tag: 900, entry_len: 96, count: 1 }));
    assert_eq!(h.sections().count(), 5);
}

#[test]
fn longer_known_frames_read_by_prefix_shorter_are_too_short() {
    // A v1 reader meets a collective that a later writer extended by 16 bytes.
    let c = sample::collective(StreamId::new(Class::P0, 0, 1), 1, 2, 3, Phase::EnqueueStart);
    let mut longer = c.as_bytes().to_vec();
    longer.extend_from_slice(&[0xaa; 16]);
    longer[8..12].copy_from_slice(&160u32.to_le_bytes());
    let Some(Ok(Frame::Collective(f))) = FrameIter::new(&longer).next() else { panic!() };
    assert_eq!(f.comm_op_seq.get(), 3);
    assert_eq!(f.hdr.length.get(), 160);

    // A collective frame cut to 136 bytes.
    let mut shorter = c.as_bytes()[..136].to_vec();
    shorter[8..12].copy_from_slice(&136u32.to_le_bytes());
    let e = malformed(FrameIter::new(&shorter).next().unwrap().unwrap());
    assert_eq!(e, DecodeError::TooShort { what: "collective", need: 144, got: 136 });
    // A framing error, by contrast, ends the iteration: nothing after it can be framed.
    let mut bad = shorter.clone();
    bad[8..12].copy_from_slice(&12u32.to_le_bytes());
    bad.extend_from_slice(&shorter);
    let mut it = FrameIter::new(&bad);
    assert_eq!(it.next().unwrap().unwrap_err(), DecodeError::BadFrameLength { offset: 0, length: 12 });
    assert!(it.next().is_none());
}

#[test]
fn every_error_has_a_nack_reason_and_label() {
    let errors = [
        DecodeError::TooShort { what: "x", need: 1, got: 0 },
        DecodeError::BadMagic { got: 0 },
        DecodeError::UnsupportedVersion { what: "x", got: 9 },
        DecodeError::LengthMismatch { what: "x", declared: 1, actual: 2 },
        DecodeError::BadFrameLength { offset: 0, length: 3 },
        DecodeError::ChecksumMismatch { expected: 1, computed: 2 },
        DecodeError::SummaryMismatch { stream_id: 1, field: "x", summary: 1, frames: 2 },
        DecodeError::LaneMismatch { offset: 0, class: 1, lane: 2 },
        DecodeError::UnexpectedSection { expected: 7, got: 1 },
        DecodeError::TooLarge { what: "x", got: 2, limit: 1 },
    ];
    for e in errors {
        assert!(e.nack_reason().name().is_some(), "{e}");
        assert!(!e.label().is_empty());
        assert!(!e.to_string().is_empty());
    }
}

#[test]
fn writer_reuses_its_buffer_and_validation_reuses_scratch() {
    // The writer cuts several batches from one buffer; each validates on its own.
    let mut w = BatchWriter::with_capacity(64 * 1024);
    let mut scratch = SummaryCheck::default();
    for batch_seq in 1..=3u64 {
        w.begin(&proto_flat::batch::BatchMeta { batch_seq, lane: Class::P2.code(), ..Default::default() });
        for i in 0..100 {
            let f = sample::bulk_packet(StreamId::new(Class::P2, 1, (i % 3) as u16), batch_seq * 1000 + i, i);
            w.push_frame(f.as_bytes()).unwrap();
        }
        let bytes = w.finish(&Default::default()).to_vec();
        let view = BatchView::parse(&bytes).unwrap();
        view.validate(&mut scratch).unwrap();
        assert_eq!(view.summary.len(), 3);
        assert_eq!(view.header.batch_seq.get(), batch_seq);
        assert_eq!(view.payload.len(), 100 * size_of::<BulkPacketFrame>());
    }
    // A frame with trailing bytes beyond its length is refused by the writer.
    let mut f = sample::bulk_packet(StreamId::new(Class::P2, 1, 0), 1, 1).as_bytes().to_vec();
    f.extend_from_slice(&[0; 8]);
    w.begin(&proto_flat::batch::BatchMeta { lane: Class::P2.code(), ..Default::default() });
    assert!(matches!(w.push_frame(&f), Err(DecodeError::LengthMismatch { .. })));
}

#[test]
fn loss_record_fields_read_back() {
    let lost = StreamId::new(Class::P2, 1, 3);
    let mut r = LossRecordFrame::new_zeroed();
    r.hdr = LossRecordFrame::make_header(0, sample::SHIPPER_STREAM, 4, 5);
    r.stream_id = U32::new(lost.0);
    r.cause = U16::new(LossCause::Rejected.code());
    r.reason = U16::new(5);
    r.first_seq = U64::new(10);
    r.last_seq = U64::new(20);
    let Some(Ok(Frame::LossRecord(f))) = FrameIter::new(r.as_bytes()).next() else { panic!() };
    assert_eq!(f.cause(), LossCause::Rejected);
    assert_eq!(f.lost_stream(), lost);
    assert_eq!(f.hdr.stream(), sample::SHIPPER_STREAM);
}
