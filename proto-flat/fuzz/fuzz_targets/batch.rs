//! Batch decoding from outside bytes: envelope, validation, every frame, every section.
//! Must never panic (overflow checks are on: cargo fuzz builds with debug assertions).
#![no_main]

use libfuzzer_sys::fuzz_target;
use proto_flat::batch::{BatchView, SummaryCheck, reseal};
use proto_flat::decode::{Frame, FrameIter};
use proto_flat::sections::Section;

fn walk(frames: FrameIter<'_>) -> u64 {
    let mut seen = 0u64;
    for frame in frames {
        let Ok(frame) = frame else { break };
        seen = seen.wrapping_add(frame.header().seq.get());
        match frame {
            Frame::Heartbeat(h) => {
                for s in h.sections() {
                    if let Section::Streams(e) = s {
                        for entry in e.iter() {
                            seen = seen.wrapping_add(entry.attempted_seq.get());
                        }
                    }
                }
            }
            Frame::SessionStart(s) => seen = seen.wrapping_add(s.sections().count() as u64),
            _ => {}
        }
    }
    seen
}

fuzz_target!(|data: &[u8]| {
    // As the aggregator sees it: a whole envelope.
    if let Ok(view) = BatchView::parse(data) {
        let _ = view.validate(&mut SummaryCheck::default());
        let _ = view.totals();
        std::hint::black_box(walk(view.frames()));
    }
    // Past the checksum: the same bytes resealed, so the fuzzer reaches framing, lane and
    // summary validation instead of stopping at a CRC it cannot forge.
    let mut owned = data.to_vec();
    reseal(&mut owned);
    if let Ok(view) = BatchView::parse(&owned) {
        let _ = view.validate(&mut SummaryCheck::default());
        std::hint::black_box(walk(view.frames()));
    }
    // As a capture file or ring drain: frames back to back with no envelope.
    std::hint::black_box(walk(FrameIter::new(data)));
});
