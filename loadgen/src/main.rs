//! `loadgen`: run, score, demo, bench. Not functional yet: it says so and exits with the
//! usage code. The demo cluster and scoring arrive with issue 9.

fn main() -> std::process::ExitCode {
    eprintln!("loadgen: skeleton only — `loadgen run`, the demo and scoring arrive with issue 9");
    eprintln!("{}", node_shipper::STATUS);
    eprintln!("{}", aggregator::STATUS);
    std::process::ExitCode::from(2)
}
