//! `node-shipper` binary. Today it reads and validates its configuration
//! (`--check-config`); shipping arrives with the rest of issue 7.

use std::process::ExitCode;

use clap::{Arg, ArgAction, Command};
use node_shipper::config::{self, Inputs};

fn command() -> Command {
    let mut cmd = Command::new("node-shipper")
        .about("ringwatch per-node sidecar: BPF rings → batches → spool → QUIC")
        .after_help(
            "Precedence: flag > environment (RINGWATCH_SHIPPER_<FIELD>) > --config file > default.\n\
             Exit codes: 0 ok, 1 runtime failure, 2 usage or configuration error.",
        )
        .arg(Arg::new("config").long("config").value_name("FILE").help("TOML configuration file"))
        .arg(
            Arg::new("check-config")
                .long("check-config")
                .action(ArgAction::SetTrue)
                .help("validate the configuration, print it, exit"),
        );
    for (name, help) in config::fields() {
        // clap wants 'static names; 14 short strings, built once per process.
        let long: &'static str = name.replace('_', "-").leak();
        cmd = cmd.arg(Arg::new(name).long(long).value_name("VALUE").help(help));
    }
    cmd
}

fn main() -> ExitCode {
    let m = command().get_matches(); // usage errors: clap prints them and exits 2
    let mut inputs = Inputs::default();
    if let Some(path) = m.get_one::<String>("config") {
        match std::fs::read_to_string(path) {
            Ok(text) => inputs.file(&text),
            Err(e) => {
                eprintln!("node-shipper: cannot read --config {path}: {e}");
                return ExitCode::from(2);
            }
        }
    }
    let env: Vec<(String, String)> = std::env::vars().collect();
    inputs.env(env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
    for (name, _) in config::fields() {
        if let Some(v) = m.get_one::<String>(name) {
            inputs.flag(name, v);
        }
    }
    let cfg = match inputs.validate() {
        Ok(c) => c,
        Err(e) => {
            eprint!("node-shipper: {e}");
            return ExitCode::from(2);
        }
    };
    if m.get_flag("check-config") {
        println!("{cfg:#?}");
        return ExitCode::SUCCESS;
    }
    eprintln!("{}", node_shipper::STATUS);
    ExitCode::from(1)
}
