//! The causal model: topology (ranks, GPUs, communicators) and the physical timeline of
//! every op on every rank.
//!
//! Invariants (what makes a scenario physically possible; `tests/causal.rs` checks them):
//! - ops on a communicator run in issue order on every rank: an op's kernel starts only
//!   after the rank's previous op on that communicator ended;
//! - a rank enqueues op i only after its op i − `enqueue_ahead` completed (run-ahead);
//!   a blocked rank therefore stops enqueuing `enqueue_ahead` ops past its last
//!   completion;
//! - a collective (and a P2P pair) completes only after every participant's kernel
//!   started: nobody completes an op a rank never entered;
//! - a GPU hung before contributing never starts another kernel; hung after
//!   contributing, its peers complete and it never does;
//! - a dead node starts and ends nothing after its death, and blocks its collectives.
//!
//! All times here are true (cluster) time in ns from the start of the run; node clocks
//! are applied when frames are written.

use proto_flat::codes::{DType, Op};
use proto_flat::frames::CommKey;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, LogNormal};

use crate::scenario::{Fault, Group, HangMode, JoinReason, MismatchField, Scenario};

const MS: f64 = 1e6;
/// Host cost of an enqueue (enqueue_start → enqueue_end).
const ENQUEUE_NS: u64 = 20_000;
/// Launch latency from enqueue_end to the earliest kernel start.
const LAUNCH_NS: u64 = 10_000;

/// Parses an op name as scenario files spell it.
#[must_use]
pub fn parse_op(name: &str) -> Option<Op> {
    use proto_flat::codes::WireEnum;
    Op::ALL.iter().copied().find(|o| o.name() == Some(name) && !matches!(o, Op::Send | Op::Recv))
}

/// Parses a dtype name as scenario files spell it.
#[must_use]
pub fn parse_dtype(name: &str) -> Option<DType> {
    use proto_flat::codes::WireEnum;
    DType::ALL.iter().copied().find(|d| d.name() == Some(name))
}

/// Deterministic 64-bit mixing (splitmix64's finaliser) for ids derived from names.
#[must_use]
pub fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

fn mix_str(seed: u64, s: &str) -> u64 {
    s.bytes().fold(mix(seed), |h, b| mix(h ^ u64::from(b)))
}

/// One rank (one per GPU).
#[derive(Debug, Clone)]
pub struct RankInfo {
    pub global: u32,
    pub node: u32,
    pub gpu: u32,
    pub pod: u32,
    pub pid: u32,
    pub cgroup_id: u64,
    pub gpu_uuid: [u8; 16],
    /// The CPU its profiler events fire on.
    pub cpu: u16,
    pub instrumented: bool,
}

/// One communicator instance.
#[derive(Debug, Clone)]
pub struct CommInfo {
    /// `spec_name/index`, e.g. `dp/3`.
    pub name: String,
    pub spec: usize,
    pub key: CommKey,
    /// Global ranks, in communicator-rank order.
    pub members: Vec<u32>,
}

/// What an op is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpKind {
    Coll {
        op: Op,
        dtype: DType,
        count: u64,
        root: u32,
    },
    /// `src`/`dst` are communicator ranks.
    P2p {
        src: u32,
        dst: u32,
        p2p_seq: u64,
        dtype: DType,
        count: u64,
    },
}

/// A CUDA-graph replay's key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GraphKey {
    pub graph_id: u64,
    pub graph_node: u32,
    pub replay_idx: u32,
}

/// Why a participant did not complete (the physical cause, not a verdict).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Block {
    /// Did not issue the op (late join / recompile / checkpoint, or an exited process).
    NotJoined(JoinReason),
    /// Its node was dead.
    NodeDead,
    /// Run-ahead: waited on its own earlier op (by id) that never completed.
    RunAhead(usize),
    /// GPU order: its previous op on this communicator (by id) never ended.
    GpuOrder(usize),
    /// Its GPU hung before contributing.
    GpuHungBefore,
    /// Its GPU hung after contributing to this op.
    GpuHungAfter,
    /// Every own step done; waiting for peers (or a hung channel).
    Peers,
}

/// One rank's part in one op.
#[derive(Debug, Clone)]
pub struct Participant {
    pub rank: u32,
    /// Communicator rank.
    pub pos: u32,
    pub local_op_seq: u64,
    pub enq_start: Option<u64>,
    pub enq_end: Option<u64>,
    pub k_start: Option<u64>,
    /// Rank-level completion (every channel ended).
    pub end: Option<u64>,
    /// End time of the channels that did end (with a hung channel: all but that one).
    pub chan_end: Option<u64>,
    pub block: Option<Block>,
    pub mismatch: Option<MismatchField>,
    /// Host lag and GPU lag applied (stragglers), ns.
    pub host_lag_ns: u64,
    pub gpu_lag_ns: u64,
    /// A GPU pause inside this op (it contributed, then stalled this long before its end).
    pub gpu_pause_ns: u64,
}

/// One op instance on one communicator.
#[derive(Debug, Clone)]
pub struct OpInst {
    pub id: usize,
    pub comm: usize,
    /// Collective counter on the communicator, from 1; 0 for P2P and graph replays.
    pub comm_op_seq: u64,
    pub kind: OpKind,
    pub sched_ns: u64,
    pub dur_ns: u64,
    pub channels: u16,
    pub graph: Option<GraphKey>,
    pub hung_channel: Option<u16>,
    pub participants: Vec<Participant>,
}

/// Topology and timeline.
#[derive(Debug, Clone)]
pub struct Model {
    pub ranks: Vec<RankInfo>,
    pub comms: Vec<CommInfo>,
    pub ops: Vec<OpInst>,
    pub horizon_ns: u64,
    /// Death time per node (`u64::MAX` if alive).
    pub dead_at: Vec<u64>,
}

/// One of a rank's ops on a communicator: its id and when (if ever) the rank completed it.
type OpEnd = (usize, Option<u64>);

struct Window {
    from: u64,
    until: u64,
}

impl Window {
    fn contains(&self, t: u64) -> bool {
        self.from <= t && t < self.until
    }
}

fn ms(v: u64) -> u64 {
    v.saturating_mul(1_000_000)
}

fn ms_f(v: f64) -> u64 {
    // Scenario times are validated non-negative and far below 2^64 ns.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, reason = "clamped to ≥ 0; f64 → u64 saturates")]
    let ns = (v.max(0.0) * MS) as u64;
    ns
}

/// Per-rank fault lookups.
#[derive(Default)]
struct RankFaults {
    not_joined: Vec<(Window, JoinReason)>,
    host_lag: Vec<(Window, u64)>,
    gpu_lag: Vec<(Window, u64)>,
    hang: Option<(u64, HangMode)>,
    hang_consumed: bool,
    /// (at, pause) of a GPU pause not yet applied.
    pause: Option<(u64, u64)>,
}

fn duration_dist(d: &crate::scenario::DurationSpec) -> LogNormal<f64> {
    let mu = d.median_ms.ln();
    let sigma = ((d.p99_ms.ln() - mu) / 2.326_348).max(0.0);
    // Validated: median > 0 and p99 ≥ median, so sigma is finite and ≥ 0.
    LogNormal::new(mu, sigma).unwrap_or_else(|_| LogNormal::new(0.0, 0.0).unwrap_or_else(|_| unreachable!()))
}

impl Model {
    /// Builds the topology and computes the whole timeline.
    #[must_use]
    pub fn build(s: &Scenario) -> Self {
        let c = &s.cluster;
        let mut rng = ChaCha8Rng::seed_from_u64(s.seed);
        let horizon_ns = ms(s.duration_ms);

        // ---- ranks
        let gpus_per_pod = (c.gpus_per_node / c.pods_per_node.max(1)).max(1);
        let mut ranks = Vec::new();
        for node in 0..c.nodes {
            for gpu in 0..c.gpus_per_node {
                let global = node * c.gpus_per_node + gpu;
                let h = mix(s.seed ^ (u64::from(global) << 20));
                let mut uuid = [0u8; 16];
                uuid[..8].copy_from_slice(&h.to_le_bytes());
                uuid[8..].copy_from_slice(&mix(h).to_le_bytes());
                let pod = gpu / gpus_per_pod;
                ranks.push(RankInfo {
                    global,
                    node,
                    gpu,
                    pod,
                    pid: 1000 + gpu * 7 + node % 5,
                    cgroup_id: 0x1_0000 + u64::from(node) * 64 + u64::from(pod),
                    gpu_uuid: uuid,
                    cpu: u16::try_from(gpu % u32::from(c.cpus_per_node)).unwrap_or(0),
                    instrumented: true,
                });
            }
        }
        let rank_of = |node: u32, gpu: u32| (node * c.gpus_per_node + gpu) as usize;

        // ---- communicators
        let mut comms = Vec::new();
        for (spec_idx, spec) in s.comms.iter().enumerate() {
            let groups: Vec<Vec<u32>> = match spec.group {
                Group::World => vec![(0..c.nodes * c.gpus_per_node).collect()],
                Group::Tensor => {
                    (0..c.nodes).map(|n| (0..c.gpus_per_node).map(|g| n * c.gpus_per_node + g).collect()).collect()
                }
                Group::Data => {
                    (0..c.gpus_per_node).map(|g| (0..c.nodes).map(|n| n * c.gpus_per_node + g).collect()).collect()
                }
                Group::Pipeline => (0..c.nodes / 2)
                    .flat_map(|pair| {
                        (0..c.gpus_per_node)
                            .map(move |g| vec![2 * pair * c.gpus_per_node + g, (2 * pair + 1) * c.gpus_per_node + g])
                    })
                    .collect(),
            };
            for (i, members) in groups.into_iter().enumerate() {
                let name = format!("{}/{i}", spec.name);
                let key = CommKey {
                    comm_hash: mix_str(s.seed, &name),
                    comm_disambiguator: mix_str(s.seed ^ 0xd15a, &name),
                    comm_instance: 1,
                };
                comms.push(CommInfo { name, spec: spec_idx, key, members });
            }
        }

        // ---- faults
        let mut rank_faults: Vec<RankFaults> = (0..ranks.len()).map(|_| RankFaults::default()).collect();
        let mut dead_at = vec![u64::MAX; c.nodes as usize];
        let mut channel_hangs: Vec<(usize, u32, u64, u16)> = Vec::new(); // (comm spec, rank, at, channel)
        let mut mismatches: Vec<(usize, u32, u64, MismatchField)> = Vec::new();
        let mut graphs: Vec<(usize, Window)> = Vec::new();
        let spec_idx = |name: &str| s.comms.iter().position(|cs| cs.name == name);
        for f in &s.faults {
            match f {
                Fault::NotJoined { node, gpu, from_ms, until_ms, reason, .. } => {
                    let until = if *reason == JoinReason::Exited { u64::MAX } else { until_ms.map_or(u64::MAX, ms) };
                    rank_faults[rank_of(*node, *gpu)].not_joined.push((Window { from: ms(*from_ms), until }, *reason));
                }
                Fault::HostStraggler { node, gpu, lag_ms, from_ms, until_ms } => rank_faults[rank_of(*node, *gpu)]
                    .host_lag
                    .push((Window { from: ms(*from_ms), until: ms(*until_ms) }, ms_f(*lag_ms))),
                Fault::GpuStraggler { node, gpu, lag_ms, from_ms, until_ms } => rank_faults[rank_of(*node, *gpu)]
                    .gpu_lag
                    .push((Window { from: ms(*from_ms), until: ms(*until_ms) }, ms_f(*lag_ms))),
                Fault::GpuHang { node, gpu, at_ms, mode } => {
                    rank_faults[rank_of(*node, *gpu)].hang = Some((ms(*at_ms), *mode));
                }
                Fault::GpuPause { node, gpu, at_ms, pause_ms } => {
                    rank_faults[rank_of(*node, *gpu)].pause = Some((ms(*at_ms), ms(*pause_ms)));
                }
                Fault::NodeDead { node, at_ms } => dead_at[*node as usize] = ms(*at_ms),
                Fault::Uninstrumented { node, gpu } => ranks[rank_of(*node, *gpu)].instrumented = false,
                Fault::ChannelHang { node, gpu, comm, at_ms, channel } => {
                    if let Some(spec) = spec_idx(comm) {
                        channel_hangs.push((spec, rank_of(*node, *gpu) as u32, ms(*at_ms), *channel));
                    }
                }
                Fault::Mismatch { node, gpu, comm, at_ms, field } => {
                    if let Some(spec) = spec_idx(comm) {
                        mismatches.push((spec, rank_of(*node, *gpu) as u32, ms(*at_ms), *field));
                    }
                }
                Fault::Graph { comm, from_ms, until_ms } => {
                    if let Some(spec) = spec_idx(comm) {
                        graphs.push((spec, Window { from: ms(*from_ms), until: ms(*until_ms) }));
                    }
                }
                Fault::KeyCollision { comm, with } => {
                    let first = |spec: Option<usize>| comms.iter().position(|ci| Some(ci.spec) == spec);
                    if let (Some(a), Some(b)) = (first(spec_idx(comm)), first(spec_idx(with))) {
                        comms[a].key = comms[b].key;
                    }
                }
                _ => {}
            }
        }

        // ---- schedules: every op instance with its scheduled (program) time
        let mut ops: Vec<OpInst> = Vec::new();
        for (ci, comm) in comms.iter().enumerate() {
            let spec = &s.comms[comm.spec];
            let mut sched: Vec<(u64, OpKind, u64, u16)> = Vec::new();
            for op in &spec.ops {
                let kind_op = parse_op(&op.op).unwrap_or(Op::AllReduce);
                let dtype = parse_dtype(&op.dtype).unwrap_or(DType::Bfloat16);
                let dist = duration_dist(&op.duration);
                let root =
                    op.root.unwrap_or(if matches!(kind_op, Op::Reduce | Op::Broadcast | Op::Gather | Op::Scatter) {
                        0
                    } else {
                        u32::MAX
                    });
                let count = op.bytes / dtype.bytes().unwrap_or(8);
                let mut t = op.start_ms;
                while ms_f(t) < horizon_ns {
                    let dur = ms_f(dist.sample(&mut rng)).max(1_000);
                    sched.push((ms_f(t), OpKind::Coll { op: kind_op, dtype, count, root }, dur, op.channels));
                    t += op.period_ms;
                }
            }
            if let Some(p2p) = &spec.p2p {
                let dist = duration_dist(&p2p.duration);
                let mut t = p2p.start_ms;
                let mut n = 0;
                while ms_f(t) < horizon_ns {
                    n += 1;
                    let dur = ms_f(dist.sample(&mut rng)).max(1_000);
                    let count = p2p.bytes / 2;
                    let kind = OpKind::P2p { src: 0, dst: 1, p2p_seq: n, dtype: DType::Bfloat16, count };
                    sched.push((ms_f(t), kind, dur, p2p.channels));
                    t += p2p.period_ms;
                }
            }
            sched.sort_by_key(|e| e.0);
            let mut comm_op_seq = 0;
            let mut replays: u32 = 0;
            for (sched_ns, kind, dur_ns, channels) in sched {
                let in_graph = matches!(kind, OpKind::Coll { .. })
                    && graphs.iter().any(|(spec, w)| *spec == comm.spec && w.contains(sched_ns));
                // One captured graph per communicator holding one collective node,
                // replayed once per scheduled step inside the window.
                let graph = in_graph.then(|| {
                    replays += 1;
                    GraphKey { graph_id: mix_str(s.seed ^ 0x6a, &comm.name), graph_node: 0, replay_idx: replays }
                });
                let seq = match (kind, graph) {
                    (OpKind::Coll { .. }, None) => {
                        comm_op_seq += 1;
                        comm_op_seq
                    }
                    _ => 0,
                };
                let positions: Vec<u32> = match kind {
                    OpKind::Coll { .. } => (0..comm.members.len() as u32).collect(),
                    OpKind::P2p { src, dst, .. } => vec![src, dst],
                };
                let participants = positions
                    .into_iter()
                    .map(|pos| Participant {
                        rank: comm.members[pos as usize],
                        pos,
                        local_op_seq: 0,
                        enq_start: None,
                        enq_end: None,
                        k_start: None,
                        end: None,
                        chan_end: None,
                        block: None,
                        mismatch: None,
                        host_lag_ns: 0,
                        gpu_lag_ns: 0,
                        gpu_pause_ns: 0,
                    })
                    .collect();
                ops.push(OpInst {
                    id: 0,
                    comm: ci,
                    comm_op_seq: seq,
                    kind,
                    sched_ns,
                    dur_ns,
                    channels: channels.max(1),
                    graph,
                    hung_channel: None,
                    participants,
                });
            }
        }
        // Program order across communicators: by scheduled time.
        ops.sort_by_key(|o| (o.sched_ns, o.comm, o.comm_op_seq));
        for (i, op) in ops.iter_mut().enumerate() {
            op.id = i;
        }

        // ---- the timeline
        let ahead = c.enqueue_ahead as usize;
        let mut local_seq = vec![0u64; ranks.len()];
        // (rank, comm) → ids and ends of that rank's ops on that comm, in order.
        let mut history: std::collections::HashMap<(u32, usize), Vec<OpEnd>> = std::collections::HashMap::new();
        #[allow(clippy::needless_range_loop, reason = "each step mutates ops[op_i] while reading other ops")]
        for op_i in 0..ops.len() {
            let (comm, sched, dur, channels) =
                (ops[op_i].comm, ops[op_i].sched_ns, ops[op_i].dur_ns, ops[op_i].channels);
            let spec = comms[comm].spec;
            let is_coll = matches!(ops[op_i].kind, OpKind::Coll { .. });
            let mut hung_after = Vec::new();
            let mut paused: Vec<(usize, u64)> = Vec::new();
            for p_i in 0..ops[op_i].participants.len() {
                let rank = ops[op_i].participants[p_i].rank;
                let r = rank as usize;
                let node = ranks[r].node as usize;
                local_seq[r] += 1;
                let hist = history.entry((rank, comm)).or_default();
                let jitter = ms_f(s.comms[spec].ops.first().map_or(0.0, |o| o.jitter_ms) * rng.random::<f64>());
                let mut block = None;
                let mut ready = Some(sched + jitter);
                for (w, reason) in &rank_faults[r].not_joined {
                    if let Some(t) = ready
                        && w.contains(t)
                    {
                        ready = if w.until == u64::MAX { None } else { Some(w.until) };
                        block = Some(Block::NotJoined(*reason));
                    }
                }
                let mut host_lag = 0;
                for (w, lag) in &rank_faults[r].host_lag {
                    if let Some(t) = ready
                        && w.contains(t)
                    {
                        host_lag = *lag;
                        ready = Some(t + lag);
                    }
                }
                if hist.len() >= ahead {
                    let (gate_op, gate_end) = hist[hist.len() - ahead];
                    match (ready, gate_end) {
                        (Some(t), Some(e)) => ready = Some(t.max(e)),
                        (Some(_), None) => {
                            ready = None;
                            block = Some(Block::RunAhead(gate_op));
                        }
                        _ => {}
                    }
                }
                if let Some(t) = ready
                    && t >= dead_at[node]
                {
                    ready = None;
                    block = Some(Block::NodeDead);
                }
                let enq_end = ready.map(|t| t + ENQUEUE_NS);
                let mut k_start = None;
                let mut gpu_lag = 0;
                if let Some(e) = enq_end {
                    let gpu_free = match hist.last() {
                        None => Some(0),
                        Some((_, end)) => *end,
                    };
                    match gpu_free {
                        None => {
                            block = Some(Block::GpuOrder(hist.last().map_or(0, |h| h.0)));
                        }
                        Some(free) => {
                            let mut cand = (e + LAUNCH_NS).max(free);
                            for (w, lag) in &rank_faults[r].gpu_lag {
                                if w.contains(cand) {
                                    gpu_lag = *lag;
                                    cand += lag;
                                }
                            }
                            k_start = Some(cand);
                            if let Some((at, mode)) = rank_faults[r].hang
                                && cand >= at
                            {
                                if mode == HangMode::AfterContributing && !rank_faults[r].hang_consumed {
                                    rank_faults[r].hang_consumed = true;
                                    hung_after.push(p_i);
                                } else {
                                    k_start = None;
                                    block = Some(Block::GpuHungBefore);
                                }
                            }
                            if is_coll
                                && let Some((at, pause)) = rank_faults[r].pause
                                && cand >= at
                            {
                                rank_faults[r].pause = None;
                                paused.push((p_i, pause));
                            }
                            if cand >= dead_at[node] {
                                k_start = None;
                                block = Some(Block::NodeDead);
                            }
                        }
                    }
                }
                let p = &mut ops[op_i].participants[p_i];
                p.local_op_seq = local_seq[r];
                p.enq_start = ready;
                p.enq_end = enq_end;
                p.k_start = k_start;
                p.block = block;
                p.host_lag_ns = host_lag;
                p.gpu_lag_ns = gpu_lag;
                if is_coll && let Some(m) = mismatches.iter_mut().find(|m| m.0 == spec && m.1 == rank && sched >= m.2) {
                    p.mismatch = Some(m.3);
                    m.2 = u64::MAX; // one op only
                }
            }
            // Completion.
            let starts: Option<Vec<u64>> = ops[op_i].participants.iter().map(|p| p.k_start).collect();
            let hang = if is_coll {
                channel_hangs
                    .iter_mut()
                    .find(|h| h.0 == spec && sched >= h.2 && ops[op_i].participants.iter().any(|p| p.rank == h.1))
            } else {
                None
            };
            let hung_channel = hang.map(|h| {
                h.2 = u64::MAX;
                h.3
            });
            if let Some(starts) = starts {
                let t_all = starts.iter().copied().max().unwrap_or(0);
                let base = t_all + dur;
                let any_dead =
                    ops[op_i].participants.iter().any(|p| dead_at[ranks[p.rank as usize].node as usize] <= base);
                for (p_i, p) in ops[op_i].participants.iter_mut().enumerate() {
                    let jitter = dur / 100 * u64::from(rng.random::<u8>() % 2) + 200 * u64::from(p.pos % 8);
                    let end = base + jitter;
                    if any_dead {
                        p.block = Some(if dead_at[ranks[p.rank as usize].node as usize] <= base {
                            Block::NodeDead
                        } else {
                            Block::Peers
                        });
                    } else if hung_after.contains(&p_i) {
                        p.chan_end = Some(end);
                        p.block = Some(Block::GpuHungAfter);
                    } else if let Some(&(_, pause)) = paused.iter().find(|x| x.0 == p_i) {
                        // Contributed (peers end on time), then stalled before its own end.
                        p.gpu_pause_ns = pause;
                        let late = end.saturating_add(pause);
                        p.end = Some(late);
                        p.chan_end = Some(late);
                        if dead_at[ranks[p.rank as usize].node as usize] <= late {
                            p.end = None;
                            p.block = Some(Block::NodeDead);
                        }
                    } else if hung_channel.is_some() {
                        p.chan_end = Some(end);
                        p.block = Some(Block::Peers);
                    } else {
                        p.end = Some(end);
                        p.chan_end = Some(end);
                    }
                }
            } else {
                for p in &mut ops[op_i].participants {
                    if p.block.is_none() {
                        p.block = Some(Block::Peers);
                    }
                }
            }
            ops[op_i].hung_channel = hung_channel.map(|ch| ch % channels);
            for p in &ops[op_i].participants {
                history.entry((p.rank, comm)).or_default().push((op_i, p.end));
            }
        }
        Self { ranks, comms, ops, horizon_ns, dead_at }
    }
}
