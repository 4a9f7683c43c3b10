//! The aggregator's batch-ingest path from outside bytes (issue 8): envelope, frames and
//! stream summary checked in place, then `Core::receive_batch` (dedup, seq accounting,
//! heartbeats, loss records, lifecycle records into the matcher), then the core's
//! timers. Must never panic, whatever a hostile peer sends. One core lives across inputs,
//! so state built by earlier inputs (open gaps, ops, dedup windows) meets later ones.
//! Input that decodes as a `resume` control message is applied as a shipper's resume
//! (`Core::handle_resume`: dedup holes, stream floors) — the other thing a shipper says.
#![no_main]

use std::sync::Mutex;

use libfuzzer_sys::fuzz_target;
use proto_flat::batch::{BatchView, SummaryCheck, reseal};
use proto_flat::control::{ControlMessage, parse_control};
use ringwatch_core::{Core, IngestConfig, MatcherConfig, NodeId};

static CORE: Mutex<Option<(Core, u64)>> = Mutex::new(None);

fn ingest(core: &mut Core, now: u64, bytes: &[u8]) {
    let Ok(view) = BatchView::parse(bytes) else { return };
    if view.validate(&mut SummaryCheck::default()).is_err() {
        return;
    }
    // As the aggregator does: the node is the certificate's, checked against the header.
    let node = NodeId(view.header.node_id.get());
    let _ = core.receive_batch(now, node, 200_000, &view);
    while core.poll_event().is_some() {}
}

fuzz_target!(|data: &[u8]| {
    let mut guard = CORE.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let (core, now) = guard.get_or_insert_with(|| (Core::new(IngestConfig::default(), MatcherConfig::default(), 0), 0));
    // Time moves on between inputs; the first byte says how far (0–255 × 10 ms).
    *now += u64::from(data.first().copied().unwrap_or(0)) * 10_000_000;
    let bytes = data.get(1..).unwrap_or(&[]);
    if let Ok(Some((ControlMessage::Resume { shipper_session, epoch, next_batch_seq, sent_ns, held, streams }, _))) =
        parse_control(bytes)
    {
        let held: Vec<(u64, u64)> = held.iter().map(|r| (r.first.get(), r.last.get())).collect();
        let floors: Vec<(u32, u64)> = streams.iter().map(|s| (s.stream_id.get(), s.floor_seq.get())).collect();
        // The node is whatever the certificate said; any id will do.
        let node = NodeId(shipper_session & 0xff);
        let _ = core.handle_resume(*now, node, shipper_session, epoch, next_batch_seq, (sent_ns, 200_000), &held, &floors);
        while core.poll_event().is_some() {}
    }
    ingest(core, *now, bytes);
    // Past the checksum, so the fuzzer reaches the core instead of stopping at a CRC.
    let mut owned = bytes.to_vec();
    reseal(&mut owned);
    ingest(core, *now, &owned);
    core.handle_timeout(*now);
    while core.poll_event().is_some() {}
    // Bounded memory is part of the contract: start over now and then.
    if core.records() > 1_000_000 {
        *guard = None;
    }
});
