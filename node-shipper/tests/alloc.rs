//! The batcher allocates nothing per batch in steady state: buffers cycle through its
//! pool (spool → ack → `recycle`), and the writer reuses its summary storage.
//!
//! A counting global allocator; this file holds one test so nothing else allocates
//! concurrently in the process while it counts.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};

use node_shipper::core::batcher::{Batcher, BatcherConfig, SessionMeta};
use proto_flat::codes::Class;
use proto_flat::header::StreamId;
use proto_flat::sample;
use zerocopy::IntoBytes;

struct Counting;

static ALLOCS: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards to the system allocator unchanged; only counts calls.
// A global allocator cannot be written without `unsafe`; this is test-only code.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[test]
fn steady_state_batching_allocates_nothing_per_batch() {
    let cfg = BatcherConfig {
        max_batch_bytes: 64 * 1024,
        bulk_batch_bytes: 64 * 1024,
        flush_interval_ns: 1_000_000,
        pool_size: 8,
        ..BatcherConfig::default()
    };
    let mut b = Batcher::new(cfg, SessionMeta { node_id: 1, epoch: 1, shipper_session: 1 });
    // Frames from 16 streams across two lanes, pre-encoded (the ring's bytes).
    let frames: Vec<Vec<u8>> = (0..16u16)
        .map(|cpu| {
            let class = if cpu % 4 == 0 { Class::P0 } else { Class::P2 };
            let f = sample::bulk_packet(StreamId::new(class, 0, cpu), 0, 0);
            f.as_bytes().to_vec()
        })
        .collect();
    let run = |rounds: u64, b: &mut Batcher| -> u64 {
        let mut batches = 0;
        for r in 0..rounds {
            for f in &frames {
                if let Some(batch) = b.push(f, r).expect("valid frame") {
                    batches += 1;
                    b.recycle(batch.bytes); // the spool acked it at once
                }
            }
            if let Some(batch) = b.poll_cut(r) {
                batches += 1;
                b.recycle(batch.bytes);
            }
        }
        batches
    };
    // Warm up: pools fill, summary tables reach their steady size.
    run(20_000, &mut b);
    let before = ALLOCS.load(Ordering::Relaxed);
    let batches = run(100_000, &mut b);
    let allocs = ALLOCS.load(Ordering::Relaxed) - before;
    println!("{batches} batches, {allocs} allocations");
    assert!(batches > 100, "the run cut batches ({batches})");
    assert_eq!(allocs, 0, "{allocs} allocations over {batches} batches in steady state");
}
