//! Control-stream decoding: what a hostile aggregator could send a shipper, and the
//! `resume` a hostile shipper could send an aggregator.
#![no_main]

use libfuzzer_sys::fuzz_target;
use proto_flat::control::{ControlMessage, parse_control};

fuzz_target!(|data: &[u8]| {
    let mut rest = data;
    while let Ok(Some((msg, used))) = parse_control(rest) {
        match msg {
            ControlMessage::Ack { ranges, .. } => {
                std::hint::black_box(ranges.iter().map(|r| r.last.get()).max());
            }
            ControlMessage::Resume { held, streams, .. } => {
                std::hint::black_box(held.iter().map(|r| r.last.get()).max());
                std::hint::black_box(streams.iter().map(|s| s.floor_seq.get()).max());
            }
            _ => {}
        }
        rest = rest.get(used..).unwrap_or(&[]);
        if used == 0 {
            break;
        }
    }
});
