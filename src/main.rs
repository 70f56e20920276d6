//! `orbitkv`: the command line. Subcommands print JSON on stdout; bad input
//! exits with status 2 and one line on stderr.

mod admin_cmd;
mod contract_cmd;
mod demo;
mod fuzz_cmd;
mod identity_cmd;
mod inspect_cmd;
mod replay_cmd;
mod serve;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "orbitkv",
    version,
    about = "KV-cache state beyond GPU memory, handed back only when provably complete"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Compute a computation identity and its sealed namespace.
    Identity(identity_cmd::Args),
    /// Evaluate a recovery contract: ranges, legal boundaries, selection.
    #[command(subcommand)]
    Contract(contract_cmd::Command),
    /// Walk through identity, sealing and hybrid boundary selection on an
    /// embedded example.
    Demo,
    /// Replay a trace on simulated backends and print the report.
    Replay(replay_cmd::Args),
    /// Fuzz the runtime with random faulty scenarios and a false-hit oracle.
    Fuzz(fuzz_cmd::Args),
    /// Run the manager: engines connect over a Unix socket.
    Serve(serve::Args),
    /// Show a running manager's sessions, operations, leases, occupancy,
    /// hit rate and misses by reason.
    Inspect(inspect_cmd::Args),
    /// Liveness and readiness of a running manager, for container probes:
    /// exit 0 ready (with --live: answering), 1 not ready, 3 not answering.
    Health(admin_cmd::HealthArgs),
    /// Where a prompt's pages are stored (DRAM, SSD, remote) and how many
    /// tokens could be restored; leases nothing.
    Lookup(admin_cmd::LookupArgs),
    /// Drop every stored page of an instance's (or the named) namespaces
    /// from DRAM and each lower tier.
    Clear(admin_cmd::ClearArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Identity(args) => identity_cmd::run(args),
        Command::Contract(cmd) => contract_cmd::run(cmd),
        Command::Demo => demo::run(),
        Command::Replay(args) => replay_cmd::run(args),
        Command::Fuzz(args) => fuzz_cmd::run(args),
        Command::Inspect(args) => inspect_cmd::run(args),
        // Its own exit codes (container probes).
        Command::Health(args) => return admin_cmd::health(args),
        Command::Lookup(args) => admin_cmd::lookup(args),
        Command::Clear(args) => admin_cmd::clear(args),
        Command::Serve(args) => {
            init_logging();
            serve::run(args)
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One line: scripts and tests read it.
            let msg = format!("{e:#}").replace('\n', " ");
            eprintln!("error: {msg}");
            // 1: the run worked and found problems; 2: bad input.
            ExitCode::from(if e.is::<Findings>() { 1 } else { 2 })
        }
    }
}

/// A run that completed and found something wrong (violations, failing
/// seeds), as opposed to bad input.
#[derive(Debug)]
pub struct Findings(pub String);

impl std::fmt::Display for Findings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Findings {}

/// Logs to stderr through tracing; `RUST_LOG` filters (default `info`).
fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

/// Reads and parses a JSON file, naming the file in the error.
fn read_json<T: serde::de::DeserializeOwned>(path: &std::path::Path) -> anyhow::Result<T> {
    use anyhow::Context as _;
    let text = std::fs::read(path).with_context(|| format!("{}", path.display()))?;
    serde_json::from_slice(&text).with_context(|| format!("{}", path.display()))
}

fn print_json<T: serde::Serialize>(value: &T) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string(value)?);
    Ok(())
}
