//! `orbitkv`: the command line. Subcommands print JSON on stdout; bad input
//! exits with status 2 and one line on stderr.

mod contract_cmd;
mod demo;
mod identity_cmd;
mod replay_cmd;

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
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Identity(args) => identity_cmd::run(args),
        Command::Contract(cmd) => contract_cmd::run(cmd),
        Command::Demo => demo::run(),
        Command::Replay(args) => replay_cmd::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One line: scripts and tests read it.
            let msg = format!("{e:#}").replace('\n', " ");
            eprintln!("error: {msg}");
            ExitCode::from(2)
        }
    }
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
