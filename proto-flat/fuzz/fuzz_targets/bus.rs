//! What a scaled-out aggregator's roles read from NATS (issue 28): every message kind
//! decoded from outside bytes (validated rkyv: an error, never a panic), and what
//! decodes applied as the roles apply it — records to a matcher-role core, node states,
//! shard health and events to an API-role core — with overflow checks on. The first
//! byte picks the kind.
#![no_main]

use libfuzzer_sys::fuzz_target;
use ringwatch_core::shard::{self, NodeSummary, RecordBatch, Role, ShardHealth, VerdictBatch};
use ringwatch_core::{Core, IngestConfig, MatcherConfig};

fuzz_target!(|data: &[u8]| {
    let Some((&kind, bytes)) = data.split_first() else { return };
    let mut core = Core::new(IngestConfig::default(), MatcherConfig::default(), 1_000_000_000);
    match kind % 4 {
        0 => {
            core.set_role(Role::Matcher { shard: 0, shards: 2 });
            if let Ok(b) = shard::decode::<RecordBatch>(bytes, "record batch") {
                core.apply_bus_records(2_000_000_000, &b.records);
                core.handle_timeout(3_000_000_000);
                while core.poll_event().is_some() {}
                let _ = core.shard_health(0, 4_000_000_000);
            }
        }
        1 => {
            core.set_role(Role::Api);
            if let Ok(n) = shard::decode::<NodeSummary>(bytes, "node summary") {
                let node = n.node;
                core.install_node(node, n);
                core.handle_timeout(3_000_000_000);
                let _ = core.node_health(2_000_000_000);
                let _ = core.p0_loss(node);
            }
        }
        2 => {
            core.set_role(Role::Api);
            if let Ok(h) = shard::decode::<ShardHealth>(bytes, "shard health") {
                core.set_shard_health(h);
                let _ = core.gpu_health(2_000_000_000);
            }
        }
        _ => {
            core.set_role(Role::Api);
            if let Ok(v) = shard::decode::<VerdictBatch>(bytes, "verdict batch") {
                core.inject_events(v.events);
                while core.poll_event().is_some() {}
            }
        }
    }
});
