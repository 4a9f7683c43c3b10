//! Control-stream decoding (what a hostile aggregator could send a shipper).
#![no_main]

use libfuzzer_sys::fuzz_target;
use proto_flat::control::{ControlMessage, parse_control};

fuzz_target!(|data: &[u8]| {
    let mut rest = data;
    while let Ok(Some((msg, used))) = parse_control(rest) {
        if let ControlMessage::Ack { ranges, .. } = msg {
            std::hint::black_box(ranges.iter().map(|r| r.last.get()).max());
        }
        rest = rest.get(used..).unwrap_or(&[]);
        if used == 0 {
            break;
        }
    }
});
