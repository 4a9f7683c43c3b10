//! Ground truth: what really happened, per collective and rank, per GPU and node, per
//! stream, and per fault — written from the simulator's physics, never from the code it
//! judges.
//!
//! Ranks are described by physical facts only: whether the rank was instrumented, when
//! (if ever, before the run's end) it enqueued, started and ended each op, why it did not
//! end (a [`Cause`]), which of its P0 frames the kernel dropped, and tags for what was
//! applied to it (lag, pause, mismatch). What a correct verdict is, given those facts and
//! the rules of docs/design.md, is the scorer's table in [`crate::expect`] — the truth
//! never re-implements the matcher's ladder. Telemetry loss is a tag, never a cause.
//!
//! GPU and node health are stated as of the run's end, from the faults applied.
//! Identifiability (per fault): a fault is identifiable when the evidence that survives
//! its loss windows distinguishes it — rules in [`identify`], one per fault kind.

use std::collections::{BTreeMap, HashMap};

use proto_flat::codes::{DROP_SLOTS, LossCause};
use proto_flat::header::StreamId;
use serde::{Deserialize, Serialize};

use crate::model::{Block, Model, OpKind};
use crate::scenario::{Fault, JoinReason, Scenario, Timers, mask};
use crate::sim::SimOptions;

/// The whole truth of a run (JSON beside each run).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GroundTruth {
    pub scenario: String,
    pub seed: u64,
    pub bulk_scale: f64,
    pub duration_ms: u64,
    /// The scenario's timers (the scorer's table uses its deadlines).
    pub timers: Timers,
    pub nodes: Vec<NodeTruth>,
    pub gpus: Vec<GpuTruth>,
    pub collectives: Vec<CollectiveTruth>,
    pub streams: Vec<StreamTruth>,
    /// Per (node, epoch, interface): the packets and bytes of bulk packet events
    /// (sampled out or not), as the kernel's per-interface counters count them.
    #[serde(default)]
    pub interfaces: Vec<InterfaceTruth>,
    pub faults: Vec<FaultTruth>,
}

/// One network interface's packets and bytes in one epoch of a node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InterfaceTruth {
    pub node: u32,
    pub epoch: u64,
    pub ifindex: u32,
    pub packets: u64,
    pub bytes: u64,
}

/// Conservation of one stream in one epoch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamTruth {
    pub node: u32,
    pub epoch: u64,
    pub stream_id: u32,
    pub class: String,
    pub ring: u8,
    pub cpu: u16,
    /// Events that happened (= attempted + sampled_out).
    pub generated: u64,
    /// Events that took a seq.
    pub attempted: u64,
    /// Frames written to the ring (what a reader sees).
    pub delivered: u64,
    /// Dropped by cause (loss-cause names).
    pub dropped: BTreeMap<String, u64>,
    pub sampled_out: u64,
}

impl StreamTruth {
    pub(crate) fn from_counters(
        node: u32,
        epoch: u64,
        stream: StreamId,
        attempted: u64,
        delivered: u64,
        drops: [u64; DROP_SLOTS],
        sampled_out: u64,
    ) -> Self {
        let dropped = drops
            .iter()
            .enumerate()
            .filter(|(_, n)| **n > 0)
            .filter_map(|(slot, n)| LossCause::from_drop_slot(slot).map(|c| (c.to_string(), *n)))
            .collect();
        Self {
            node,
            epoch,
            stream_id: stream.0,
            class: stream.class().to_string(),
            ring: stream.ring(),
            cpu: stream.cpu(),
            generated: attempted + sampled_out,
            attempted,
            delivered,
            dropped,
            sampled_out,
        }
    }

    /// generated = delivered + dropped (all causes) + sampled out.
    #[must_use]
    pub fn conserved(&self) -> bool {
        self.generated == self.delivered + self.dropped.values().sum::<u64>() + self.sampled_out
    }
}

/// Why a rank did not end an op (by the run's end or ever): the physical cause.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Cause {
    /// It never issued the op (a checkpoint or recompile pause, or its process exited).
    NotJoined { reason: JoinReason },
    /// Its node was dead.
    NodeDead,
    /// Its host waited on its own earlier op (`comm#seq`) that never ended (run-ahead).
    RunAhead { behind: String },
    /// Its GPU waited on its previous op on this communicator (`comm#seq`), which never
    /// ended there.
    GpuOrder { behind: String },
    /// Its GPU hung before contributing.
    GpuHungBefore,
    /// Its GPU hung after contributing.
    GpuHungAfter,
    /// Every own step done; it waited on peers (or on a hung channel).
    Peers,
}

/// One rank's part in one op: physical facts only.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankTruth {
    /// Communicator rank.
    pub rank: u32,
    pub global_rank: u32,
    pub node: u32,
    pub gpu: u32,
    /// The rank runs the profiler shim (frames and PROGRESS exist for it).
    pub instrumented: bool,
    /// What was applied to it: `telemetry_loss`, `mismatch(field)`,
    /// `straggler(gpu,Nms)`, `straggler(host)`, `gpu_pause(Nms)`, `graph_captured`.
    pub tags: Vec<String>,
    /// Enqueued / kernel started / ended, before the run's end.
    pub entered: bool,
    pub started: bool,
    pub completed: bool,
    /// When (simulated ms), if before the run's end.
    pub enqueued_ms: Option<f64>,
    pub started_ms: Option<f64>,
    pub ended_ms: Option<f64>,
    /// Why it never ended (`None` when it ended, even after the run's end).
    pub cause: Option<Cause>,
    /// P0 frames of this rank for this op the kernel dropped.
    pub lost_frames: u32,
}

/// One op instance (collective, P2P, or graph replay).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CollectiveTruth {
    pub comm: String,
    pub comm_hash: u64,
    pub comm_op_seq: u64,
    pub op: String,
    pub p2p_seq: Option<u64>,
    pub graph_replay: Option<u32>,
    pub sched_ms: f64,
    /// Simulated time (ms) of the op's first enqueue or kernel start (`sched_ms` if none).
    pub first_start_ms: f64,
    /// Another communicator instance uses this op's key and `comm_op_seq`.
    pub key_collision: bool,
    /// The activation mask has a completion source (kernel channels or proxy).
    pub completion_source: bool,
    /// The channel that never ended on any rank, if one hung.
    pub hung_channel: Option<u16>,
    /// Simulated time (ms) of the op's last event any participant's kernel side emitted
    /// (enqueue, kernel start, channel or rank end; before the run's end and its node's
    /// death); `sched_ms` when it emitted none.
    pub last_event_ms: f64,
    /// A summary: `ok`, `ok_with_loss`, `in_flight`, `hung` (some rank never ends),
    /// `mismatch`, `indeterminate` (colliding key or no completion source).
    pub state: String,
    pub ranks: Vec<RankTruth>,
}

/// Health of one GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuTruth {
    pub node: u32,
    pub gpu: u32,
    pub gpu_uuid: String,
    /// `healthy`, `healthy_lossy`, `suspect`, `degraded`, `silent`, `unreachable`.
    pub health: String,
    pub why: Vec<String>,
}

/// Health of one node (its worst GPU).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeTruth {
    pub node: u32,
    pub name: String,
    pub health: String,
    pub dead_at_ms: Option<u64>,
}

/// One injected fault.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FaultTruth {
    pub kind: String,
    pub fault: Fault,
    /// `simulator` or `harness` (shipper/transport faults are only scheduled here).
    pub applied_by: String,
    pub identifiable: bool,
    pub why: String,
}

fn health_rank(h: &str) -> u8 {
    match h {
        "unreachable" => 6,
        "silent" => 5,
        "degraded" => 4,
        "suspect" => 3,
        "healthy_lossy" => 2,
        _ => 1,
    }
}

/// Scenario milliseconds to nanoseconds, saturating (values come from a file).
fn ns(ms: u64) -> u64 {
    ms.saturating_mul(1_000_000)
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Builds the truth from the model, the kernel drops and the stream counters.
pub(crate) fn build(
    s: &Scenario,
    options: &SimOptions,
    m: &Model,
    lost_p0: &HashMap<(u32, u16), u32>,
    streams: Vec<StreamTruth>,
    interfaces: Vec<InterfaceTruth>,
) -> GroundTruth {
    let horizon = m.horizon_ns;
    let ms = 1_000_000u64;
    let stuck = ns(s.timers.stuck_deadline_ms);
    let can_complete = s.cluster.activation_mask & (mask::KERNEL_CH | mask::PROXY) != 0;

    // Key collisions: (key, comm_op_seq) used by more than one communicator instance.
    let mut by_key: HashMap<(u64, u64, u64, u64), Vec<usize>> = HashMap::new();
    for op in m.ops.iter().filter(|o| o.comm_op_seq > 0) {
        let k = m.comms[op.comm].key;
        by_key.entry((k.comm_hash, k.comm_disambiguator, k.comm_instance, op.comm_op_seq)).or_default().push(op.comm);
    }

    let mut collectives = Vec::new();
    for op in &m.ops {
        let comm = &m.comms[op.comm];
        let k = comm.key;
        let collided = by_key
            .get(&(k.comm_hash, k.comm_disambiguator, k.comm_instance, op.comm_op_seq))
            .is_some_and(|c| c.iter().any(|&x| x != op.comm));
        let all_done = op.participants.iter().all(|p| p.end.is_some());
        // Every missing end has a physical cause (a block); ends past the horizon are
        // still `Some`, so an op cut by the end of the run is in flight, not hung.
        let hung = !all_done;
        let first_start = op.participants.iter().filter_map(|p| p.enq_start.or(p.k_start)).min().unwrap_or(op.sched_ns);
        let before_end = |t: Option<u64>| t.filter(|&t| t < horizon);
        #[allow(clippy::cast_precision_loss, reason = "ms for people")]
        let to_ms = |t: u64| t as f64 / 1e6;
        let mut ranks = Vec::new();
        let mut any_loss = false;
        let mut any_mismatch = false;
        for (pi, p) in op.participants.iter().enumerate() {
            let r = &m.ranks[p.rank as usize];
            let lost = lost_p0
                .get(&(u32::try_from(op.id).unwrap_or(u32::MAX), u16::try_from(pi).unwrap_or(0)))
                .copied()
                .unwrap_or(0);
            let mut tags = Vec::new();
            if lost > 0 {
                tags.push("telemetry_loss".to_owned());
                any_loss = true;
            }
            if let Some(f) = p.mismatch {
                tags.push(format!(
                    "mismatch({})",
                    serde_json::to_value(f).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default()
                ));
                any_mismatch = true;
            }
            if p.gpu_lag_ns > 0 {
                tags.push(format!("straggler(gpu,{}ms)", p.gpu_lag_ns / ms));
            }
            if p.host_lag_ns > 0 {
                tags.push("straggler(host)".to_owned());
            }
            if p.gpu_pause_ns > 0 {
                tags.push(format!("gpu_pause({}ms)", p.gpu_pause_ns / ms));
            }
            if op.graph.is_some() {
                tags.push("graph_captured".to_owned());
            }
            let name_of = |id: usize| {
                let b = &m.ops[id];
                format!("{}#{}", m.comms[b.comm].name, b.comm_op_seq)
            };
            let cause = if p.end.is_some() {
                None
            } else {
                Some(match p.block {
                    Some(Block::NodeDead) => Cause::NodeDead,
                    Some(Block::NotJoined(reason)) => Cause::NotJoined { reason },
                    Some(Block::GpuHungBefore) => Cause::GpuHungBefore,
                    Some(Block::GpuHungAfter) => Cause::GpuHungAfter,
                    Some(Block::RunAhead(id)) => Cause::RunAhead { behind: name_of(id) },
                    Some(Block::GpuOrder(id)) => Cause::GpuOrder { behind: name_of(id) },
                    Some(Block::Peers) | None => Cause::Peers,
                })
            };
            ranks.push(RankTruth {
                rank: p.pos,
                global_rank: p.rank,
                node: r.node,
                gpu: r.gpu,
                instrumented: r.instrumented,
                tags,
                entered: p.enq_start.is_some_and(|t| t < horizon),
                started: p.k_start.is_some_and(|t| t < horizon),
                completed: p.end.is_some_and(|e| e < horizon),
                enqueued_ms: before_end(p.enq_start).map(to_ms),
                started_ms: before_end(p.k_start).map(to_ms),
                ended_ms: before_end(p.end).map(to_ms),
                cause,
                lost_frames: lost,
            });
        }
        let state = if collided || (!can_complete && op.graph.is_none()) {
            "indeterminate"
        } else if any_mismatch {
            "mismatch"
        } else if hung {
            "hung"
        } else if !ranks.iter().all(|r| r.completed) {
            "in_flight"
        } else if any_loss {
            "ok_with_loss"
        } else {
            "ok"
        };
        let (op_name, p2p_seq) = match op.kind {
            OpKind::Coll { op, .. } => (op.to_string(), None),
            OpKind::P2p { p2p_seq, .. } => ("send_recv".to_owned(), Some(p2p_seq)),
        };
        #[allow(clippy::cast_precision_loss, reason = "ms for people")]
        let sched_ms = op.sched_ns as f64 / 1e6;
        let last_event_ns = op
            .participants
            .iter()
            .flat_map(|p| {
                let dead = m.dead_at.get(m.ranks[p.rank as usize].node as usize).copied().unwrap_or(u64::MAX);
                [p.enq_start, p.enq_end, p.k_start, p.end, p.chan_end]
                    .into_iter()
                    .flatten()
                    .filter(move |&t| t < horizon && t < dead)
            })
            .max()
            .unwrap_or(op.sched_ns);
        #[allow(clippy::cast_precision_loss, reason = "ms for people")]
        let last_event_ms = last_event_ns as f64 / 1e6;
        collectives.push(CollectiveTruth {
            comm: comm.name.clone(),
            comm_hash: k.comm_hash,
            comm_op_seq: op.comm_op_seq,
            op: op_name,
            p2p_seq,
            graph_replay: op.graph.map(|g| g.replay_idx),
            sched_ms,
            first_start_ms: to_ms(first_start),
            key_collision: collided,
            completion_source: can_complete,
            hung_channel: op.hung_channel,
            last_event_ms,
            state: state.to_owned(),
            ranks,
        });
    }

    // GPU health from the physics.
    let lossy_nodes: std::collections::BTreeSet<u32> = streams
        .iter()
        .filter(|st| st.class == "p0" && st.dropped.values().sum::<u64>() > 0)
        .map(|st| st.node)
        .collect();
    // Ranks in an op with a hung channel whose stuck deadline passed by the end.
    let channel_hung: std::collections::BTreeSet<usize> = m
        .ops
        .iter()
        .filter(|o| o.hung_channel.is_some())
        .filter(|o| {
            o.participants.iter().filter_map(|p| p.k_start).min().is_some_and(|t| t.saturating_add(stuck) < horizon)
        })
        .flat_map(|o| o.participants.iter().map(|p| p.rank as usize))
        .collect();
    let mut gpus = Vec::new();
    for r in &m.ranks {
        let mut health = if lossy_nodes.contains(&r.node) { "healthy_lossy" } else { "healthy" };
        let mut why = Vec::new();
        let mut raise = |h: &'static str, reason: String, why: &mut Vec<String>| {
            if health_rank(h) > health_rank(health) {
                health = h;
            }
            why.push(reason);
        };
        for f in &s.faults {
            match *f {
                Fault::GpuHang { node, gpu, at_ms, .. } if node == r.node && gpu == r.gpu && ns(at_ms) < horizon => {
                    raise("degraded", format!("gpu hung at {at_ms} ms"), &mut why);
                }
                // A pause past the stuck deadline is a stuck GPU until it ends; it is
                // degraded until `degraded_clear_ms` after its end, then healthy again.
                Fault::GpuPause { node, gpu, .. } if node == r.node && gpu == r.gpu => {
                    if let Some((first, end)) = pause_of(m, r.global)
                        && first.saturating_add(stuck) < end.min(horizon)
                    {
                        let cleared = end < horizon
                            && s.timers
                                .degraded_clear_ms
                                .is_some_and(|c| end.saturating_add(c.saturating_mul(ms)) <= horizon);
                        if !cleared {
                            raise(
                                "degraded",
                                format!("gpu paused past the stuck deadline from {} ms", first / ms),
                                &mut why,
                            );
                        }
                    }
                }
                // A channel that never ends on every rank singles out nobody: every
                // participant of the hung op is suspect, none degraded.
                Fault::ChannelHang { at_ms, channel, .. } if channel_hung.contains(&(r.global as usize)) => {
                    raise("suspect", format!("in an op whose channel {channel} hung at {at_ms} ms"), &mut why);
                }
                // A lag within the straggler bound is not a straggler (the aggregator is
                // given the same threshold).
                Fault::GpuStraggler { node, gpu, lag_ms, .. }
                    if node == r.node
                        && gpu == r.gpu
                        && lag_ms > s.timers.straggler_threshold_ms.max(6.0 * s.timers.clock_epsilon_ms) =>
                {
                    raise("degraded", format!("gpu-side straggler, {lag_ms} ms"), &mut why);
                }
                // Suspect once the absence reached the join deadline (a pause that ended
                // sooner — a checkpoint — leaves the GPU healthy).
                Fault::NotJoined { node, gpu, from_ms, until_ms, reason, .. }
                    if node == r.node
                        && gpu == r.gpu
                        && ns(from_ms) < horizon
                        && (reason == JoinReason::Exited
                            || until_ms.is_none_or(|u| u.saturating_sub(from_ms) >= s.timers.join_deadline_ms)) =>
                {
                    raise("suspect", format!("not joined from {from_ms} ms (host side)"), &mut why);
                }
                Fault::NodeDead { node, at_ms } if node == r.node && ns(at_ms) < horizon => {
                    let h = if horizon >= ns(at_ms).saturating_add(ns(60_000)) { "unreachable" } else { "silent" };
                    raise(h, format!("node dead at {at_ms} ms"), &mut why);
                }
                _ => {}
            }
        }
        gpus.push(GpuTruth { node: r.node, gpu: r.gpu, gpu_uuid: hex(&r.gpu_uuid), health: health.to_owned(), why });
    }
    let nodes = (0..s.cluster.nodes)
        .map(|n| {
            let health = gpus
                .iter()
                .filter(|g| g.node == n)
                .map(|g| g.health.as_str())
                .max_by_key(|h| health_rank(h))
                .unwrap_or("healthy")
                .to_owned();
            let dead = m.dead_at[n as usize];
            NodeTruth {
                node: n,
                name: crate::sim::Simulation::node_name(n),
                health,
                dead_at_ms: (dead != u64::MAX).then_some(dead / ms),
            }
        })
        .collect();

    let faults = s
        .faults
        .iter()
        .map(|f| {
            let (identifiable, why) = identify(s, m, lost_p0, f);
            FaultTruth {
                kind: f.kind().to_owned(),
                fault: f.clone(),
                applied_by: if f.applied_by_simulator() { "simulator" } else { "harness" }.to_owned(),
                identifiable,
                why,
            }
        })
        .collect();

    GroundTruth {
        scenario: s.name.clone(),
        seed: s.seed,
        bulk_scale: options.bulk_scale,
        duration_ms: s.duration_ms,
        timers: s.timers.clone(),
        nodes,
        gpus,
        collectives,
        streams,
        interfaces,
        faults,
    }
}

/// Where rank `global` paused its GPU: (the op's first start, the pause's end; `u64::MAX`
/// when it never ended), ns.
fn pause_of(m: &Model, global: u32) -> Option<(u64, u64)> {
    m.ops.iter().find_map(|o| {
        let p = o.participants.iter().find(|p| p.rank == global && p.gpu_pause_ns > 0)?;
        let first = o.participants.iter().filter_map(|p| p.enq_start.or(p.k_start)).min().unwrap_or(o.sched_ns);
        Some((first, p.end.unwrap_or(u64::MAX)))
    })
}

/// The evidence rules: is this fault distinguishable from what survives?
fn identify(s: &Scenario, m: &Model, lost_p0: &HashMap<(u32, u16), u32>, f: &Fault) -> (bool, String) {
    let ms = 1_000_000u64;
    let horizon = m.horizon_ns;
    let mask = s.cluster.activation_mask;
    let rank = |node: u32, gpu: u32| &m.ranks[(node * s.cluster.gpus_per_node + gpu) as usize];
    let hb = ns(s.timers.heartbeat_ms);
    match *f {
        Fault::RingOverflow { .. } => (true, "kernel drop counters and seq holes cover every dropped frame".into()),
        Fault::GpuHang { node, gpu, at_ms, .. } => {
            let r = rank(node, gpu);
            let alive = m.dead_at[node as usize] > ns(at_ms).saturating_add(ns(s.timers.stuck_deadline_ms));
            let late_enough = horizon >= ns(at_ms).saturating_add(ns(s.timers.stuck_deadline_ms)).saturating_add(hb);
            let ok = r.instrumented && mask & mask::KERNEL_CH != 0 && alive && late_enough;
            (
                ok,
                format!(
                    "needs kernel-channel events and PROGRESS of an instrumented, live rank past the stuck deadline \
                 (instrumented={}, kernel_ch={}, alive={alive}, deadline_passed={late_enough})",
                    r.instrumented,
                    mask & mask::KERNEL_CH != 0
                ),
            )
        }
        Fault::GpuPause { node, gpu, pause_ms, .. } => {
            let r = rank(node, gpu);
            let stuck = s.timers.stuck_deadline_ms.saturating_mul(ms);
            let past = pause_of(m, r.global).is_some_and(|(first, end)| {
                first.saturating_add(stuck).saturating_add(hb) < end.min(horizon)
                    && m.dead_at[node as usize] > first.saturating_add(stuck)
            });
            let ok = r.instrumented && mask & mask::KERNEL_CH != 0 && past;
            (
                ok,
                format!(
                    "a {pause_ms} ms pause is a stuck GPU only past the stuck deadline and a heartbeat, with \
                     kernel-channel events and PROGRESS (instrumented={}, kernel_ch={}, past_deadline={past})",
                    r.instrumented,
                    mask & mask::KERNEL_CH != 0
                ),
            )
        }
        Fault::ChannelHang { .. } => {
            (false, "the hung channel is missing on every rank: no rank-level evidence singles out the culprit".into())
        }
        Fault::NotJoined { node, gpu, from_ms, .. } => {
            let r = rank(node, gpu);
            let late_enough = horizon >= ns(from_ms).saturating_add(ns(s.timers.join_deadline_ms));
            (
                r.instrumented && late_enough,
                format!(
                    "needs fresh PROGRESS showing the rank behind past the join deadline (instrumented={}, deadline_passed={late_enough})",
                    r.instrumented
                ),
            )
        }
        Fault::GpuStraggler { node, gpu, lag_ms, .. } => {
            let r = rank(node, gpu);
            let bound = s.timers.straggler_threshold_ms.max(6.0 * s.timers.clock_epsilon_ms);
            let instances = m
                .ops
                .iter()
                .flat_map(|o| o.participants.iter())
                .filter(|p| p.rank == r.global && p.gpu_lag_ns > 0)
                .count();
            let ok = lag_ms > bound && instances >= 3 && mask & mask::KERNEL_CH != 0 && r.instrumented;
            (ok, format!("lag {lag_ms} ms vs bound {bound} ms, {instances} lagging instances (need 3 of 5)"))
        }
        Fault::HostStraggler { node, gpu, .. } => {
            let r = rank(node, gpu);
            (r.instrumented && mask & mask::COLL != 0, "enqueue times show the lag is host-side".into())
        }
        Fault::Mismatch { node, gpu, .. } => {
            let r = rank(node, gpu);
            let survived = m.ops.iter().any(|o| {
                o.participants.iter().enumerate().any(|(pi, p)| {
                    p.rank == r.global
                        && p.mismatch.is_some()
                        && lost_p0
                            .get(&(u32::try_from(o.id).unwrap_or(u32::MAX), u16::try_from(pi).unwrap_or(0)))
                            .is_none()
                })
            });
            (
                survived && r.instrumented && mask & mask::COLL != 0,
                format!("the mismatching frames survived: {survived}"),
            )
        }
        Fault::NodeDead { node: _, at_ms } => {
            let ok = horizon >= ns(at_ms).saturating_add(ns(s.timers.silent_ms));
            (ok, format!("silence past the silent timer by the end of the run: {ok}"))
        }
        Fault::Graph { .. } => {
            let ok = mask & mask::KERNEL_CH != 0;
            (ok, format!("graph replays are visible only through kernel-channel records: {ok}"))
        }
        Fault::KeyCollision { .. } => (true, "nranks disagree at the shared key".into()),
        Fault::Uninstrumented { .. } => (true, "no PROGRESS entry: indeterminate(uninstrumented)".into()),
        Fault::CounterReset { .. } => (true, "a new epoch closes the old one".into()),
        Fault::Reorder { .. } => (true, "late frames fill their holes before the reorder timeout".into()),
        Fault::SpoolOverflow { .. }
        | Fault::ShipperRestart { .. }
        | Fault::AggregatorRestart { .. }
        | Fault::Partition { .. }
        | Fault::DuplicateBatches { .. } => {
            (true, "applied by the harness; loss records and gaps account for it".into())
        }
    }
}
