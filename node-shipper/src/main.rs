//! `node-shipper` binary. Not functional yet: it says so and exits with the usage code.

fn main() -> std::process::ExitCode {
    eprintln!("{}", node_shipper::STATUS);
    std::process::ExitCode::from(2)
}
