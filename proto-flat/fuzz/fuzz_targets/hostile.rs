//! Structure-aware hostile input (issue 18): scripts of batches that pass `validate` —
//! collectives, P2P and bulk frames, heartbeats, loss records, session starts, shipper
//! gaps, epoch starts, with numbers drawn to the edges (0, 2^62 ± 1, i64::MAX, u64::MAX)
//! — resumes, time passing and disconnects, between rounds of honest traffic, fed to
//! `Core::receive_batch`, `handle_resume`, the timers and the API's reads. Overflow
//! checks are on (this crate's release profile). One core lives across inputs.
//!
//! The generator is `aggregator/core/tests/hostile_input`, shared with the stable test
//! `generated_hostile_scripts_never_panic_the_core`.
#![no_main]

#[path = "../../../aggregator/core/tests/hostile_input/mod.rs"]
mod hostile_input;

use std::sync::Mutex;

use libfuzzer_sys::fuzz_target;
use ringwatch_core::{Core, IngestConfig, MatcherConfig};

/// The core, its time, the honest side's counters, and how many inputs it has taken.
type State = (Core, u64, hostile_input::Honest, u32);

static STATE: Mutex<Option<State>> = Mutex::new(None);

/// Inputs one core takes before a fresh one: enough for state built by earlier inputs to
/// meet later ones, few enough that the state (and so each input's cost) stays small.
const INPUTS_PER_CORE: u32 = 2_000;

fuzz_target!(|script: hostile_input::Script| {
    let mut guard = STATE.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let (core, now, honest, inputs) = guard.get_or_insert_with(|| {
        (Core::new(IngestConfig::default(), MatcherConfig::default(), 0), 0, hostile_input::Honest::default(), 0)
    });
    hostile_input::run(core, now, honest, &script);
    *inputs += 1;
    if *inputs >= INPUTS_PER_CORE || core.records() > 1_000_000 {
        *guard = None;
    }
});
