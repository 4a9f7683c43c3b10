//! `loadgen-sim`: the causal cluster simulator, fault injection, ground truth, and the
//! capture format.
//!
//! It depends on `proto-flat` only — never on the aggregator — so ground truth never
//! comes from the code it judges.
//!
//! Status: the workspace skeleton (issue 2); the simulator arrives with issue 3.
