//! Scoring verdicts against the simulator's ground truth. Pure: truth and the API's DTOs
//! in, a [`Score`] out (a table for people, JSON for scripts).
//!
//! What each rank is owed comes from the table in `loadgen_sim::expect` (the ground
//! truth states physical facts only; that table maps them to the outcome vocabulary of
//! docs/design.md — it sits in `loadgen-sim` so the core's tests judge with the same
//! table). Where timing alone decides between two verdicts the table names both, and
//! either is right.
//!
//! What counts as right for an owed verdict (documented once, here):
//! - the same outcome; `waiting_on` must name the truth's culprit when both name one
//!   (`waiting_on(3)` for `waiting_on(5)` is wrong; `waiting_on(unknown)` names none
//!   and is right for either); `blocked_by` must name the root op the table names;
//! - `completed_inferred` for a rank the truth says `completed` *and* whose frames the
//!   kernel dropped, or whose node died (its last frames died with its shipper: the
//!   completion was inferred because the telemetry was lost);
//! - `unknown_silent` for a rank on a node that died (the aggregator cannot know more);
//! - `indeterminate(uninstrumented)` for a rank on a node that died before the aggregator
//!   heard anything from it (nothing of the rank was ever on the wire: to the aggregator
//!   it is a rank without instrumentation, and it says so);
//! - `completed` for a rank the truth calls `indeterminate(key_collision)` that did
//!   complete, when the op sharing its key only appears later (the verdict was final,
//!   and true, before the collision was visible).
//!
//! Node health must be the truth's (`silent` and `unreachable` are one answer); a node
//! that died before the aggregator heard anything of it is absent from its node list,
//! and that is right.
//!
//! Communicators whose keys collide share op keys, so one verdict stands for a rank of
//! each: it is scored once, and right only if right for every truth op with its key.
//!
//! Only final verdicts of ranks the truth marks decidable are scored (ops no rank ever
//! entered are not: nothing of them is on the wire); the rest are
//! counted (`non_final`), and those whose op is older than the stuck deadline + reorder
//! timeout + 2 heartbeats at the end are listed apart, with the ones a silent node gates.

use std::collections::{BTreeMap, HashMap};

use aggregator::api::dto::{NodesDto, VerdictDto, VerdictsDto};
use loadgen_sim::GroundTruth;
use loadgen_sim::expect::{Expected, Table};
use serde::Serialize;

/// Precision and recall of one outcome.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct OutcomeScore {
    /// Decidable ranks the truth gives this outcome.
    pub truth: u64,
    /// Final verdicts with this outcome.
    pub predicted: u64,
    pub correct: u64,
    pub precision: f64,
    pub recall: f64,
}

/// Conservation of one node's streams.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct NodeConservation {
    pub node: String,
    pub streams: u64,
    /// Streams where received + lost + sampled out = generated.
    pub exact: u64,
    /// Streams where received, lost by cause and sampled out each equal the generator's.
    pub equal_to_generator: u64,
    pub generated: u64,
    pub received: u64,
    pub lost: u64,
    pub sampled_out: u64,
    /// The node died: events after its last heartbeat were never reported by anyone, so
    /// its streams are exact when every seq its last heartbeat announced is in an explicit
    /// state (received, lost, pending, or in transit with the dead shipper) — vacuously
    /// so for a stream of which nothing reached the aggregator before the death;
    /// `unknowable_tail` is what the generator made that the aggregator never received.
    pub dead: bool,
    pub unknowable_tail: u64,
}

/// Distribution summary, ms.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Distribution {
    pub count: u64,
    pub p50_ms: u64,
    pub p99_ms: u64,
    pub max_ms: u64,
}

/// The whole score.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Score {
    pub scenario: String,
    pub seed: u64,
    pub scale: f64,
    pub decidable_ranks: u64,
    /// Ops in the schedule that no rank ever entered (hosts blocked by run-ahead behind a
    /// hung op): nothing on the wire, no verdict possible; not scored.
    pub ops_never_issued: u64,
    pub final_verdicts: u64,
    pub final_right: u64,
    /// A few wrong ones: (op, rank, truth, verdict).
    pub wrong_examples: Vec<(String, u32, String, String)>,
    pub outcomes: BTreeMap<String, OutcomeScore>,
    /// Decidable ranks with no final verdict, and those of them old enough to need one
    /// (older than stuck deadline + reorder + 2 heartbeats at the end), and how many of
    /// those a silent node gates.
    pub non_final: u64,
    pub non_final_old: u64,
    pub non_final_old_gated_by_silent: u64,
    /// Decidable ranks with no final verdict whose op has a participant on a node that
    /// died (docs/design.md, "Liveness and the silent-node rule": a silent participant
    /// does not let the others' verdicts be final until it is unreachable or back): the
    /// scorer's silent-node excuse.
    pub non_final_gated_by_silent: u64,
    /// A few old non-final ones not gated by a silent node: (op, rank, truth, verdict so far).
    pub non_final_examples: Vec<(String, u32, String, String)>,
    /// Nodes called degraded that the truth does not degrade, and the converse.
    pub false_degraded: u64,
    pub missed_degraded: u64,
    /// Node health equal to the truth's.
    pub nodes_right: u64,
    /// The others: (node, truth, got).
    pub health_wrong: Vec<(String, String, String)>,
    /// Node health, `truth → aggregator`: count (the confusion table of node health).
    pub health_confusion: BTreeMap<String, u64>,
    pub nodes: u64,
    /// Identifiable culprits (GPU hangs and pauses past the stuck deadline: a `stuck`
    /// verdict on their node; GPU-side
    /// stragglers: their node degraded) found.
    pub culprits: u64,
    pub culprits_found: u64,
    /// Final verdicts that left a rank unfinished (`stuck`, `waiting_on`, `blocked_by`,
    /// `not_joined`) for a rank that did complete before the run's end, none of whose
    /// frames were lost: each owes a recovery on the API (`recovered_at_ms`).
    pub recoveries_owed: u64,
    pub recoveries_seen: u64,
    /// Aggregator time a verdict became final, after the op's last frame (simulated time;
    /// the aggregator's clock runs at the same scale).
    pub time_to_final: Distribution,
    pub conservation: Vec<NodeConservation>,
}

fn base(s: &str) -> &str {
    s.split('(').next().unwrap_or("")
}

/// The same outcome; for `waiting_on`, the same culprit when both name a rank (naming
/// none where the truth knows one is not naming a wrong one).
fn same_outcome(truth: &str, verdict: &str) -> bool {
    let arg = |s: &str| s.split_once('(').map(|(_, a)| a.trim_end_matches(')').to_owned());
    base(truth) == base(verdict)
        && match base(truth) {
            "waiting_on" => match (arg(truth).as_deref(), arg(verdict).as_deref()) {
                (Some(t), Some(v)) if t != "unknown" && v != "unknown" => t == v,
                _ => true,
            },
            // The same root op: the truth says `comm#seq`, the API `#seq` (the verdict's
            // own communicator).
            "blocked_by" => truth.rsplit('#').next() == verdict.rsplit('#').next(),
            _ => true,
        }
}

/// Whether two health names are the same answer. `silent` and `unreachable` are one:
/// "nothing heard" — the simulator calls a dead node unreachable after 60 s, while the
/// aggregator also does as soon as the node's connection is gone (docs/design.md,
/// "Timers": 60 s *or* connection closed), which a dead node's QUIC idle timeout brings
/// sooner.
#[must_use]
pub fn same_health(a: &str, b: &str) -> bool {
    a == b || (matches!(a, "silent" | "unreachable") && matches!(b, "silent" | "unreachable"))
}

/// What became of a rank's node, as far as scoring goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeFate {
    Alive,
    /// Died after the aggregator heard from it.
    Died,
    /// Died before anything of it reached the aggregator.
    DiedUnheard,
}

/// Whether a verdict is right for what the table owes the rank (either answer where it
/// names two).
#[must_use]
pub fn agrees_expected(e: &Expected, verdict: &str, lost_frames: u32, node: NodeFate, completed: bool) -> bool {
    agrees(&e.outcome, verdict, lost_frames, node, completed)
        || e.alternative.as_deref().is_some_and(|a| agrees(a, verdict, lost_frames, node, completed))
}

/// Whether a verdict outcome is right for a truth outcome (see the module docs).
#[must_use]
pub fn agrees(truth: &str, verdict: &str, lost_frames: u32, node: NodeFate, completed: bool) -> bool {
    let node_dead = node != NodeFate::Alive;
    same_outcome(truth, verdict)
        || (truth == "completed" && verdict == "completed_inferred" && (lost_frames > 0 || node_dead))
        || (verdict == "unknown_silent" && node_dead)
        || (verdict == "indeterminate(uninstrumented)" && node == NodeFate::DiedUnheard)
        // A key shared with an op that only appears later: judged (correctly) before the
        // collision could be seen.
        || (truth == "indeterminate(key_collision)"
            && completed
            && (verdict == "completed" || (verdict == "completed_inferred" && lost_frames > 0)))
}

/// The op key a verdict and the truth share: (kind, comm hash hex, seq).
fn truth_key(c: &loadgen_sim::truth::CollectiveTruth) -> Option<(String, String, u64)> {
    let comm = format!("{:016x}", c.comm_hash);
    if c.graph_replay.is_some() {
        None
    } else if let Some(p) = c.p2p_seq {
        Some(("p2p".into(), comm, p))
    } else if c.comm_op_seq > 0 {
        Some(("collective".into(), comm, c.comm_op_seq))
    } else {
        None
    }
}

/// Scores a run. `ended_at_ms` is the aggregator time the verdicts were read at;
/// `reorder_ms` the aggregator's reorder timeout in simulated ms (the table's slack).
#[must_use]
pub fn score(
    truth: &GroundTruth,
    nodes: &NodesDto,
    verdicts: &VerdictsDto,
    ended_at_ms: u64,
    reorder_ms: f64,
) -> Score {
    let timers = &truth.timers;
    let table = Table::new(truth, reorder_ms);
    let mut s =
        Score { scenario: truth.scenario.clone(), seed: truth.seed, scale: truth.bulk_scale, ..Score::default() };
    let by_key: BTreeMap<(String, String, u64, u32), &VerdictDto> =
        verdicts.verdicts.iter().map(|v| ((v.op.kind.clone(), v.op.comm.clone(), v.op.seq, v.rank), v)).collect();
    let dead: Vec<bool> = truth.nodes.iter().map(|n| n.dead_at_ms.is_some()).collect();
    // An aggregator restart leaves every node a knowledge gap (snapshot → first batch after
    // it); an op one of whose nodes has one may be `indeterminate(aggregator_gap)`: the
    // aggregator says it cannot judge across what it forgot, which is right.
    let gap: Vec<bool> = (0u32..)
        .zip(&truth.nodes)
        .map(|(i, _)| {
            let name = aggregator::certs::node_name(i);
            nodes.nodes.iter().any(|n| n.name == name && !n.knowledge_gaps.is_empty())
        })
        .collect();
    let across_gap = |outcome: &str, c: &loadgen_sim::truth::CollectiveTruth| {
        outcome == "indeterminate(aggregator_gap)"
            && c.ranks.iter().any(|r| gap.get(r.node as usize).copied().unwrap_or(false))
    };
    let fate: Vec<NodeFate> = (0u32..)
        .zip(&truth.nodes)
        .map(|(i, n)| {
            if n.dead_at_ms.is_none() {
                return NodeFate::Alive;
            }
            let name = aggregator::certs::node_name(i);
            let heard = nodes
                .nodes
                .iter()
                .find(|x| x.name == name)
                .is_some_and(|x| x.streams.iter().any(|st| st.received > 0 || st.prior_instance > 0));
            if heard { NodeFate::Died } else { NodeFate::DiedUnheard }
        })
        .collect();
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, reason = "ms")]
    let old_before =
        ended_at_ms.saturating_sub(timers.stuck_deadline_ms + reorder_ms.max(0.0) as u64 + 2 * timers.heartbeat_ms);
    let mut ttf = Vec::new();
    // Colliding communicators share op keys: one verdict stands for the rank of every
    // truth op with its key. It is scored once, and right only if right for each.
    let mut scored: HashMap<(String, String, u64, u32), (String, bool)> = HashMap::new();
    for c in &truth.collectives {
        let Some((kind, comm, seq)) = truth_key(c) else { continue };
        if !c.ranks.iter().any(|r| r.entered) {
            s.ops_never_issued += 1;
            continue;
        }
        for r in &c.ranks {
            let e = table.expected(c, r);
            if !e.decidable {
                continue;
            }
            let node_fate = fate.get(r.node as usize).copied().unwrap_or(NodeFate::Alive);
            let key = (kind.clone(), comm.clone(), seq, r.rank);
            if let Some((credited, right)) = scored.get_mut(&key) {
                let v = by_key.get(&key).filter(|v| v.is_final);
                if let Some(v) = v
                    && *right
                    && !(agrees_expected(&e, &v.outcome, r.lost_frames, node_fate, r.completed)
                        || across_gap(&v.outcome, c))
                {
                    *right = false;
                    s.final_right -= 1;
                    if let Some(o) = s.outcomes.get_mut(credited.as_str()) {
                        o.correct -= 1;
                    }
                    if s.wrong_examples.len() < 10 {
                        s.wrong_examples.push((format!("{}#{seq}", c.comm), r.rank, e.outcome.clone(), describe(v)));
                    }
                }
                continue;
            }
            s.decidable_ranks += 1;
            // Where the table names two right answers, the one the verdict gave is the
            // truth's for the confusion table (so it shows what the aggregator said).
            let final_verdict = by_key.get(&key).filter(|v| v.is_final);
            let owed = match (final_verdict, e.alternative.as_deref()) {
                (Some(v), Some(alt))
                    if !agrees(&e.outcome, &v.outcome, r.lost_frames, node_fate, r.completed)
                        && agrees(alt, &v.outcome, r.lost_frames, node_fate, r.completed) =>
                {
                    alt
                }
                _ => e.outcome.as_str(),
            };
            let t = base(owed).to_owned();
            s.outcomes.entry(t.clone()).or_default().truth += 1;
            match by_key.get(&key).filter(|v| v.is_final) {
                Some(v) => {
                    s.final_verdicts += 1;
                    scored.insert(
                        key.clone(),
                        (
                            t.clone(),
                            (agrees_expected(&e, &v.outcome, r.lost_frames, node_fate, r.completed)
                                || across_gap(&v.outcome, c)),
                        ),
                    );
                    let got = base(&v.outcome).to_owned();
                    s.outcomes.entry(got.clone()).or_default().predicted += 1;
                    if r.completed
                        && r.lost_frames == 0
                        && node_fate == NodeFate::Alive
                        && matches!(got.as_str(), "stuck" | "waiting_on" | "blocked_by" | "not_joined")
                    {
                        s.recoveries_owed += 1;
                        s.recoveries_seen += u64::from(v.recovered_at_ms.is_some());
                    }
                    if agrees_expected(&e, &v.outcome, r.lost_frames, node_fate, r.completed)
                        || across_gap(&v.outcome, c)
                    {
                        s.final_right += 1;
                        // Credit the truth's outcome (the equivalences map onto it).
                        s.outcomes.entry(t.clone()).or_default().correct += 1;
                        if got != t {
                            // Counted as predicted for `got`, correct for `t`: move it.
                            if let Some(o) = s.outcomes.get_mut(&got) {
                                o.predicted -= 1;
                            }
                            s.outcomes.entry(t.clone()).or_default().predicted += 1;
                        }
                    } else if s.wrong_examples.len() < 10 {
                        s.wrong_examples.push((format!("{}#{seq}", c.comm), r.rank, e.outcome.clone(), describe(v)));
                    }
                    if let Some(f) = v.final_at_ms {
                        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, reason = "ms")]
                        ttf.push(f.saturating_sub(c.last_event_ms.max(0.0) as u64));
                    }
                }
                None => {
                    scored.insert(key.clone(), (t.clone(), false));
                    s.non_final += 1;
                    if c.ranks.iter().any(|x| dead.get(x.node as usize).copied().unwrap_or(false)) {
                        s.non_final_gated_by_silent += 1;
                    }
                    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, reason = "ms")]
                    if (c.sched_ms.max(0.0) as u64) < old_before {
                        s.non_final_old += 1;
                        let gated = c.ranks.iter().any(|x| dead.get(x.node as usize).copied().unwrap_or(false));
                        if gated {
                            s.non_final_old_gated_by_silent += 1;
                        } else if s.non_final_examples.len() < 10 {
                            let so_far = by_key.get(&key).map_or_else(|| "none".to_owned(), |v| v.outcome.clone());
                            s.non_final_examples.push((format!("{}#{seq}", c.comm), r.rank, e.outcome.clone(), so_far));
                        }
                    }
                }
            }
        }
    }
    #[allow(clippy::cast_precision_loss, reason = "ratios")]
    for o in s.outcomes.values_mut() {
        o.precision = if o.predicted == 0 { 1.0 } else { o.correct as f64 / o.predicted as f64 };
        o.recall = if o.truth == 0 { 1.0 } else { o.correct as f64 / o.truth as f64 };
    }
    ttf.sort_unstable();
    let q = |p: f64| {
        #[allow(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            clippy::cast_precision_loss,
            reason = "index"
        )]
        let i = ((ttf.len().saturating_sub(1)) as f64 * p).round() as usize;
        ttf.get(i).copied().unwrap_or(0)
    };
    s.time_to_final = Distribution {
        count: ttf.len() as u64,
        p50_ms: q(0.5),
        p99_ms: q(0.99),
        max_ms: ttf.last().copied().unwrap_or(0),
    };

    // Health.
    for n in &truth.nodes {
        s.nodes += 1;
        let got = nodes.nodes.iter().find(|x| x.name == n.name).map_or("unknown", |x| x.health.as_str());
        // A node that died before anything of it reached the aggregator is not listed
        // there at all: it never existed on the wire (seen beside a CPU hog: node-07's
        // shipper had not connected before the node died).
        let unheard = fate.get(n.node as usize) == Some(&NodeFate::DiedUnheard) && got == "unknown";
        *s.health_confusion.entry(format!("{} → {got}", n.health)).or_default() += 1;
        if same_health(got, &n.health) || unheard {
            s.nodes_right += 1;
        } else {
            s.health_wrong.push((n.name.clone(), n.health.clone(), got.to_owned()));
        }
        if got == "degraded" && n.health != "degraded" {
            s.false_degraded += 1;
        }
        if n.health == "degraded" && got != "degraded" {
            s.missed_degraded += 1;
        }
    }
    for f in truth.faults.iter().filter(|f| f.identifiable) {
        match &f.fault {
            loadgen_sim::Fault::GpuHang { node, .. } | loadgen_sim::Fault::GpuPause { node, .. } => {
                s.culprits += 1;
                let name = aggregator::certs::node_name(*node);
                if verdicts.verdicts.iter().any(|v| v.outcome == "stuck" && v.node.as_deref() == Some(name.as_str())) {
                    s.culprits_found += 1;
                }
            }
            loadgen_sim::Fault::GpuStraggler { node, .. } => {
                s.culprits += 1;
                let name = aggregator::certs::node_name(*node);
                if nodes.nodes.iter().any(|x| x.name == name && x.health == "degraded") {
                    s.culprits_found += 1;
                }
            }
            _ => {}
        }
    }

    s.conservation = conservation(truth, nodes);
    s
}

/// A verdict for a WRONG line: outcome, then what decided it and when.
fn describe(v: &VerdictDto) -> String {
    format!(
        "{} (evidence: {}; decided {} ms, final {} ms, revision {})",
        v.outcome,
        v.evidence,
        v.decided_at_ms,
        v.final_at_ms.map_or_else(|| "-".to_owned(), |f| f.to_string()),
        v.revision
    )
}

/// Conservation of every node's streams against the generator's counts (part of
/// [`score`]; also what a run waits for before it is scored).
#[must_use]
pub fn conservation(truth: &GroundTruth, nodes: &NodesDto) -> Vec<NodeConservation> {
    let dead: Vec<bool> = truth.nodes.iter().map(|n| n.dead_at_ms.is_some()).collect();
    let mut per: BTreeMap<u32, NodeConservation> = BTreeMap::new();
    for t in &truth.streams {
        let name = aggregator::certs::node_name(t.node);
        let dead_node = dead.get(t.node as usize).copied().unwrap_or(false);
        let c = per.entry(t.node).or_insert_with(|| NodeConservation {
            node: name.clone(),
            dead: dead_node,
            ..NodeConservation::default()
        });
        c.streams += 1;
        c.generated += t.generated;
        let got = nodes
            .nodes
            .iter()
            .find(|n| n.name == name)
            .and_then(|n| n.streams.iter().find(|x| x.epoch == t.epoch && x.stream_id == t.stream_id));
        if let Some(g) = got {
            c.received += g.received;
            c.lost += g.lost_total;
            c.sampled_out += g.sampled_out;
            // prior_instance: seqs another aggregator instance had (a restart), not loss.
            let accounted = g.received + g.lost_total + g.prior_instance + g.sampled_out;
            if dead_node {
                // Everything announced (attempted + sampled out at the last heartbeat) is
                // accounted for; the rest was never on the wire.
                // Every seq its last heartbeat announced is in an explicit state —
                // received, lost, pending or in transit (the shipper died with it).
                let known = g.received + g.lost_total + g.prior_instance + g.pending + g.in_transit;
                if known >= g.attempted && accounted <= t.generated {
                    c.exact += 1;
                }
                c.unknowable_tail += t.generated - accounted.min(t.generated);
            } else if accounted == t.generated {
                c.exact += 1;
            }
            if g.received == t.delivered && g.lost == t.dropped && g.sampled_out == t.sampled_out {
                c.equal_to_generator += 1;
            }
        } else if dead_node {
            // The node died before anything of this stream reached the aggregator (at 4×
            // time a node that dies early may not get a batch through): nothing was
            // announced, so nothing announced is unaccounted — all of it is the tail
            // nobody could report.
            c.exact += 1;
            c.unknowable_tail += t.generated;
        }
    }
    per.into_values().collect()
}

impl Score {
    /// Every final verdict right, nothing falsely degraded, every stream exact, every
    /// identifiable culprit found, nothing old left non-final except behind a silent node,
    /// every node's health the truth's, every recovery owed reported.
    #[must_use]
    pub fn perfect(&self) -> bool {
        self.final_right == self.final_verdicts
            && self.false_degraded == 0
            && self.conservation.iter().all(|c| c.exact == c.streams)
            && self.culprits_found == self.culprits
            && self.non_final_old == self.non_final_old_gated_by_silent
            && self.nodes_right == self.nodes
            && self.recoveries_seen == self.recoveries_owed
    }

    /// The table for people.
    #[must_use]
    pub fn table(&self) -> String {
        use std::fmt::Write;
        let mut o = String::new();
        let _ = writeln!(o, "scenario {}  seed {}  scale {:e}", self.scenario, self.seed, self.scale);
        let _ = writeln!(
            o,
            "final verdicts right: {}/{}  (decidable ranks {}, not final {}, old and not final {} of which gated by a silent node {})",
            self.final_right,
            self.final_verdicts,
            self.decidable_ranks,
            self.non_final,
            self.non_final_old,
            self.non_final_old_gated_by_silent
        );
        let _ = writeln!(
            o,
            "{:<28} {:>8} {:>9} {:>8} {:>9} {:>7}",
            "outcome", "truth", "predicted", "correct", "precision", "recall"
        );
        for (name, x) in &self.outcomes {
            let _ = writeln!(
                o,
                "{name:<28} {:>8} {:>9} {:>8} {:>9.3} {:>7.3}",
                x.truth, x.predicted, x.correct, x.precision, x.recall
            );
        }
        let _ = writeln!(
            o,
            "node health right {}/{}; false degraded {}; missed degraded {}; identifiable culprits found {}/{}",
            self.nodes_right, self.nodes, self.false_degraded, self.missed_degraded, self.culprits_found, self.culprits
        );
        let _ = writeln!(
            o,
            "node health (truth → aggregator): {}",
            self.health_confusion.iter().map(|(k, v)| format!("{k} {v}")).collect::<Vec<_>>().join(", ")
        );
        if self.recoveries_owed > 0 {
            let _ = writeln!(
                o,
                "recoveries reported: {}/{} (final unfinished verdicts whose rank completed after all)",
                self.recoveries_seen, self.recoveries_owed
            );
        }
        for (node, truth, got) in &self.health_wrong {
            let _ = writeln!(o, "  health of {node}: truth {truth}, aggregator {got}");
        }
        let t = &self.time_to_final;
        let _ = writeln!(
            o,
            "time to final (ms after the op's last frame): p50 {}  p99 {}  max {}  ({} verdicts)",
            t.p50_ms, t.p99_ms, t.max_ms, t.count
        );
        let _ = writeln!(
            o,
            "{:<10} {:>8} {:>6} {:>10} {:>12} {:>12} {:>10} {:>12}  note",
            "node", "streams", "exact", "= gen", "generated", "received", "lost", "sampled out"
        );
        for c in &self.conservation {
            let note = if c.dead {
                format!("died: {} events after its last heartbeat never reported", c.unknowable_tail)
            } else {
                String::new()
            };
            let _ = writeln!(
                o,
                "{:<10} {:>8} {:>6} {:>10} {:>12} {:>12} {:>10} {:>12}  {note}",
                c.node, c.streams, c.exact, c.equal_to_generator, c.generated, c.received, c.lost, c.sampled_out
            );
        }
        for (op, rank, t, v) in &self.wrong_examples {
            let _ = writeln!(o, "WRONG {op} rank {rank}: truth {t}, verdict {v}");
        }
        if self.non_final_old > self.non_final_old_gated_by_silent {
            for (op, rank, t, v) in &self.non_final_examples {
                let _ =
                    writeln!(o, "NOT FINAL (old, not gated by a silent node) {op} rank {rank}: truth {t}, so far {v}");
            }
        }
        o
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equivalences_are_narrow() {
        use NodeFate::{Alive, Died, DiedUnheard};
        assert!(!agrees("waiting_on(3)", "waiting_on(5)", 0, Alive, false), "the wrong culprit named");
        assert!(agrees("waiting_on(3)", "waiting_on(3)", 0, Alive, false));
        assert!(agrees("waiting_on(3)", "waiting_on(unknown)", 0, Alive, false), "no culprit named");
        assert!(agrees("waiting_on(unknown)", "waiting_on(5)", 0, Alive, false));
        assert!(agrees("completed", "completed_inferred", 2, Alive, true));
        assert!(!agrees("completed", "completed_inferred", 0, Alive, true), "inferred without loss is not right");
        assert!(agrees("completed", "completed_inferred", 0, Died, true), "frames that died with the node's shipper");
        assert!(agrees("blocked_by(world#3)", "unknown_silent", 0, Died, false));
        assert!(agrees("blocked_by(world/0#21)", "blocked_by(#21)", 0, Alive, false));
        assert!(!agrees("blocked_by(world/0#22)", "blocked_by(#21)", 0, Alive, false), "another root named");
        assert!(!agrees("stuck", "unknown_silent", 0, Alive, false), "silence only excuses a dead node's ranks");
        assert!(!agrees("completed", "stuck", 0, Alive, true));
        assert!(agrees("indeterminate(key_collision)", "completed", 0, Alive, true));
        assert!(!agrees("indeterminate(key_collision)", "completed", 0, Alive, false));
        assert!(agrees("completed", "indeterminate(uninstrumented)", 0, DiedUnheard, true), "never on the wire");
        assert!(!agrees("completed", "indeterminate(uninstrumented)", 0, Died, true), "it was heard: not right");
        assert!(!agrees("completed", "indeterminate(uninstrumented)", 0, Alive, true));
    }
}
