//! The causal rules hold for every scenario and many seeds: scenarios are physically
//! possible.

mod common;

use std::collections::HashMap;

use loadgen_sim::model::{Block, OpKind};
use loadgen_sim::{SimOptions, Simulation, builtin};
use proptest::prelude::*;

fn check_model(sim: &Simulation) {
    let m = sim.model();
    let ahead = sim.scenario().cluster.enqueue_ahead as usize;
    // (rank, comm) → that rank's ops on that comm, in issue order.
    let mut per: HashMap<(u32, usize), Vec<(usize, usize)>> = HashMap::new();
    for op in &m.ops {
        for (pi, p) in op.participants.iter().enumerate() {
            per.entry((p.rank, op.comm)).or_default().push((op.id, pi));
            // Phases in order.
            if let (Some(e), Some(k)) = (p.enq_end, p.k_start) {
                assert!(e <= k, "kernel before enqueue: op {}", op.id);
            }
            if let (Some(k), Some(end)) = (p.k_start, p.end) {
                assert!(k < end, "end before start: op {}", op.id);
            }
            assert!(p.k_start.is_none() || p.enq_start.is_some(), "a kernel without an enqueue");
            assert!(p.end.is_none() || p.k_start.is_some(), "a completion without a start");
        }
        // Nobody completes an op a participant never entered or never started.
        if op.participants.iter().any(|p| p.end.is_some()) {
            let last_start = op.participants.iter().map(|p| p.k_start.expect("every participant started")).max();
            for p in &op.participants {
                assert!(p.enq_start.is_some(), "op {} completed by a peer but rank {} never entered", op.id, p.rank);
                if let Some(end) = p.end {
                    assert!(Some(end) > last_start, "completed before the last participant started");
                }
            }
        }
        // A GPU hung before contributing never starts again.
        for p in &op.participants {
            if p.block == Some(Block::GpuHungBefore) {
                assert!(p.k_start.is_none());
            }
        }
        if let OpKind::P2p { .. } = op.kind {
            assert_eq!(op.comm_op_seq, 0, "P2P never advances comm_op_seq");
            assert_eq!(op.participants.len(), 2);
        }
    }
    for ops in per.values() {
        for (i, &(id, pi)) in ops.iter().enumerate() {
            let p = &m.ops[id].participants[pi];
            // Issue order on the GPU: starts after the previous op on this comm ended.
            if i > 0 {
                let (pid, ppi) = ops[i - 1];
                let prev = &m.ops[pid].participants[ppi];
                if let Some(k) = p.k_start {
                    let prev_end = prev.end.expect("started after a predecessor that never ended");
                    assert!(k >= prev_end);
                }
            }
            // Run-ahead: enqueue i only after op i − ahead completed.
            if i >= ahead {
                let (gid, gpi) = ops[i - ahead];
                let gate = &m.ops[gid].participants[gpi];
                if let Some(e) = p.enq_start {
                    assert!(gate.end.is_some_and(|g| g <= e), "enqueued past the run-ahead window");
                }
            }
        }
    }
    // A dead node starts nothing after its death.
    for op in &m.ops {
        for p in &op.participants {
            let dead = m.dead_at[m.ranks[p.rank as usize].node as usize];
            for t in [p.enq_start, p.k_start, p.end].into_iter().flatten() {
                assert!(t < dead, "activity on a dead node");
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 8, ..ProptestConfig::default() })]

    /// The causal rules, for every scenario at many seeds.
    #[test]
    fn causal_rules_hold(seed in any::<u64>()) {
        for (name, _) in builtin::BUILTIN {
            let s = builtin::builtin(name).unwrap().unwrap();
            let sim = Simulation::new(&s, SimOptions { bulk_scale: 0.0, seed: Some(seed) }).unwrap();
            check_model(&sim);
        }
    }
}

#[test]
fn progress_never_reports_completion_before_start_or_start_before_enqueue() {
    for (name, _) in builtin::BUILTIN {
        let s = builtin::builtin(name).unwrap().unwrap();
        let (_, check, truth) = common::run(&s, None, 0.0);
        for (_, p) in &check.progress {
            assert!(p.last_completed_op.get() <= p.last_kernel_started_op.get() || truth.scenario == "enqueue-only");
            if s.cluster.activation_mask & loadgen_sim::scenario::mask::COLL != 0 {
                assert!(p.last_kernel_started_op.get() <= p.last_enqueued_op.get(), "{name}: {p:?}");
            }
        }
        // Strong collectives: if any rank completed, every rank entered.
        for c in &truth.collectives {
            if c.ranks.iter().any(|r| r.completed) {
                assert!(c.ranks.iter().all(|r| r.entered), "{name}: {c:?}");
            }
        }
    }
}

#[test]
fn blocked_ranks_stop_enqueuing_after_enqueue_ahead() {
    // counter-case: enqueue_ahead = 8; the hung GPU's host runs at most 8 ops past its
    // last completion, then stops.
    let s = builtin::builtin("counter-case").unwrap().unwrap();
    let (sim, _, _) = common::run(&s, None, 0.0);
    let m = sim.model();
    let culprit = m.ranks.iter().find(|r| r.node == 3 && r.gpu == 0).unwrap().global;
    let mine: Vec<_> =
        m.ops.iter().flat_map(|o| o.participants.iter().filter(|p| p.rank == culprit).map(move |p| (o, p))).collect();
    let last_done = mine.iter().rposition(|(_, p)| p.end.is_some()).unwrap();
    let entered_after = mine[last_done + 1..].iter().filter(|(_, p)| p.enq_start.is_some()).count();
    assert_eq!(entered_after, 8, "run-ahead of exactly enqueue_ahead ops past the last completion");
}
