//! `loadgen`: run, score, demo, bench. Not functional yet: it says so and exits with the
//! usage code. The demo cluster and scoring arrive with issue 9; until then the
//! 8-shipper end-to-end test (`tests/tests/transport.rs`) is what runs the whole path.

fn main() -> std::process::ExitCode {
    eprintln!("loadgen: skeleton only — `loadgen run`, the demo and scoring arrive with issue 9");
    eprintln!("today: node-shipper and aggregator run for real (QUIC + mTLS); see README for the end-to-end test");
    std::process::ExitCode::from(2)
}
