//! Turning a batch that will never be delivered into loss records.

use proto_flat::DecodeError;
use proto_flat::batch::BatchView;
use proto_flat::codes::{LossCause, WireEnum};
use proto_flat::frames::{FixedFrame, LossRecordFrame};
use proto_flat::header::StreamId;
use zerocopy::FromZeros;
use zerocopy::little_endian::{U16, U32, U64};

/// What one stream lost in one batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LostRange {
    pub stream_id: u32,
    pub first_seq: u64,
    pub last_seq: u64,
    pub count: u64,
    pub first_ts: u64,
    pub last_ts: u64,
    pub shipper_session: u64,
    pub batch_seq: u64,
    pub cause: LossCause,
    pub reason: u16,
}

impl LostRange {
    /// Extends this range by `r` when `r` continues it: the same stream, cause and reason,
    /// and `r` starts one past this range's last seq. Returns whether it did.
    pub fn extend_if_adjacent(&mut self, r: &Self) -> bool {
        let adjacent = self.stream_id == r.stream_id
            && self.cause == r.cause
            && self.reason == r.reason
            && self.last_seq.checked_add(1) == Some(r.first_seq);
        if adjacent {
            self.last_seq = r.last_seq;
            self.count = self.count.saturating_add(r.count);
            self.last_ts = self.last_ts.max(r.last_ts);
        }
        adjacent
    }

    /// Adds `r` to `ranges`: merged into the last range of its stream when it continues
    /// it (one record per stream for a run of lost batches), appended otherwise.
    pub fn merge_into(ranges: &mut Vec<Self>, r: Self) {
        let merged =
            ranges.iter_mut().rev().find(|p| p.stream_id == r.stream_id).is_some_and(|p| p.extend_if_adjacent(&r));
        if !merged {
            ranges.push(r);
        }
    }

    /// A stream-summary entry's frames, lost: `(shipper_session, batch_seq)` names the
    /// batch (`batch_seq` 0: one never numbered or sent).
    #[must_use]
    pub fn of_summary(
        e: &proto_flat::sections::StreamSummaryEntry,
        (shipper_session, batch_seq): (u64, u64),
        cause: LossCause,
        reason: u16,
    ) -> Self {
        Self {
            stream_id: e.stream_id.get(),
            first_seq: e.first_seq.get(),
            last_seq: e.last_seq.get(),
            count: u64::from(e.frame_count.get()),
            first_ts: e.first_ts.get(),
            last_ts: e.last_ts.get(),
            shipper_session,
            batch_seq,
            cause,
            reason,
        }
    }

    /// The loss record frame for it, on the shipper's own P1 stream.
    #[must_use]
    pub fn to_frame(&self, stream: StreamId, seq: u64, ts_ns: u64) -> LossRecordFrame {
        let mut f = LossRecordFrame::new_zeroed();
        f.hdr = LossRecordFrame::make_header(0, stream, seq, ts_ns);
        f.first_seq = U64::new(self.first_seq);
        f.last_seq = U64::new(self.last_seq);
        f.first_ts = U64::new(self.first_ts);
        f.last_ts = U64::new(self.last_ts);
        f.count = U64::new(self.count);
        f.shipper_session = U64::new(self.shipper_session);
        f.batch_seq = U64::new(self.batch_seq);
        f.stream_id = U32::new(self.stream_id);
        f.cause = U16::new(self.cause.code());
        f.reason = U16::new(self.reason);
        f
    }
}

/// One range per stream-summary entry of `batch` (a batch this shipper built).
///
/// # Errors
/// A batch that does not parse: only possible if the spool's bytes were corrupted, and
/// the caller must count it (`shipper_internal`) rather than lose it silently.
pub fn lost_ranges(batch: &[u8], cause: LossCause, reason: u16) -> Result<Vec<LostRange>, DecodeError> {
    let view = BatchView::parse_own(batch)?;
    let (session, batch_seq) = (view.header.shipper_session.get(), view.header.batch_seq.get());
    Ok(view.summary.iter().map(|e| LostRange::of_summary(e, (session, batch_seq), cause, reason)).collect())
}

#[cfg(test)]
mod tests {
    use super::super::batcher::{Batcher, BatcherConfig, SessionMeta};
    use super::*;
    use proto_flat::codes::Class;
    use proto_flat::sample;
    use zerocopy::IntoBytes;

    #[test]
    fn a_dropped_batch_becomes_one_range_per_stream_with_every_frame_counted() {
        let mut b = Batcher::new(BatcherConfig::default(), SessionMeta { node_id: 1, epoch: 1, shipper_session: 9 });
        let (s1, s2) = (StreamId::new(Class::P2, 1, 0), StreamId::new(Class::P2, 2, 0));
        for seq in 0..30 {
            b.push(sample::bulk_packet(s1, seq, 100 + seq).as_bytes(), 0).unwrap();
        }
        for seq in 5..12 {
            b.push(sample::bulk_packet(s2, seq, 200 + seq).as_bytes(), 0).unwrap();
        }
        let batch = b.flush().pop().unwrap();
        let mut r = lost_ranges(&batch.bytes, LossCause::ShipperSpoolFull, 0).unwrap();
        r.sort_by_key(|x| x.stream_id);
        assert_eq!(r.len(), 2);
        assert_eq!((r[0].first_seq, r[0].last_seq, r[0].count, r[0].first_ts), (0, 29, 30, 100));
        assert_eq!((r[1].first_seq, r[1].last_seq, r[1].count, r[1].last_ts), (5, 11, 7, 211));
        assert!(r.iter().all(|x| x.batch_seq == batch.batch_seq && x.shipper_session == 9));
        let f = r[1].to_frame(StreamId::new(Class::P1, 0, 0), 4, 77);
        assert_eq!((f.first_seq.get(), f.count.get(), f.cause.get()), (5, 7, LossCause::ShipperSpoolFull.code()));
        assert!(lost_ranges(&batch.bytes[..20], LossCause::ShipperSpoolFull, 0).is_err(), "corruption is an error");
    }

    #[test]
    fn merge_into_joins_a_streams_adjacent_runs_and_keeps_gaps_causes_and_streams_apart() {
        let r = |stream_id, first_seq, last_seq, cause| LostRange {
            stream_id,
            first_seq,
            last_seq,
            count: last_seq - first_seq + 1,
            first_ts: first_seq.saturating_mul(10),
            last_ts: last_seq.saturating_mul(10),
            shipper_session: 1,
            batch_seq: 0,
            cause,
            reason: 0,
        };
        let spool = LossCause::ShipperSpoolFull;
        let mut v = Vec::new();
        LostRange::merge_into(&mut v, r(1, 0, 9, spool));
        LostRange::merge_into(&mut v, r(2, 0, 4, spool));
        LostRange::merge_into(&mut v, r(1, 10, 19, spool)); // continues stream 1 past stream 2's
        LostRange::merge_into(&mut v, r(2, 6, 7, spool)); // a gap: seq 5 was not lost
        LostRange::merge_into(&mut v, r(1, 20, 20, LossCause::ShipperShutdown)); // another cause
        let got: Vec<_> = v.iter().map(|x| (x.stream_id, x.first_seq, x.last_seq, x.count, x.last_ts)).collect();
        assert_eq!(got, [(1, 0, 19, 20, 190), (2, 0, 4, 5, 40), (2, 6, 7, 2, 70), (1, 20, 20, 1, 200)]);
        let mut last = r(3, u64::MAX, u64::MAX, spool);
        assert!(!last.extend_if_adjacent(&r(3, 0, 0, spool)), "seq arithmetic never wraps");
    }
}
