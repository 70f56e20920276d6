//! `orbitkv contract ...`: the recovery contract on JSON files.

use std::path::PathBuf;

use anyhow::Result;
use clap::Subcommand;
use orbitkv_components::{
    ContractSpec, Namespace, RecoveryContract, StateBundle, prompt_limit, select_boundary,
};

use crate::{print_json, read_json};

#[derive(Subcommand)]
pub enum Command {
    /// Print the required (group, start, end) ranges for a span.
    Ranges {
        #[arg(long)]
        contract: PathBuf,
        #[arg(long)]
        start: u64,
        #[arg(long)]
        end: u64,
        /// Namespace of the query; defaults to the contract's own.
        #[arg(long)]
        namespace: Option<Namespace>,
    },
    /// Print every legal boundary of one rank's bundle.
    Boundaries {
        #[arg(long)]
        contract: PathBuf,
        #[arg(long)]
        bundle: PathBuf,
    },
    /// Print the boundaries legal on every rank (one --bundle per rank).
    Common {
        #[arg(long)]
        contract: PathBuf,
        #[arg(long = "bundle", required = true)]
        bundles: Vec<PathBuf>,
    },
    /// Print the largest common boundary usable for a prompt, or null.
    Select {
        #[arg(long)]
        contract: PathBuf,
        #[arg(long = "bundle", required = true)]
        bundles: Vec<PathBuf>,
        #[arg(long)]
        prompt_len: u64,
    },
}

fn load(path: &std::path::Path) -> Result<RecoveryContract> {
    let spec: ContractSpec = read_json(path)?;
    Ok(RecoveryContract::compile(&spec)?)
}

fn bundles(paths: &[PathBuf]) -> Result<Vec<StateBundle>> {
    paths.iter().map(|p| read_json(p)).collect()
}

pub fn run(cmd: Command) -> Result<()> {
    match cmd {
        Command::Ranges {
            contract,
            start,
            end,
            namespace,
        } => {
            let c = load(&contract)?;
            print_json(&c.required_ranges(namespace.unwrap_or(c.namespace()), start, end)?)
        }
        Command::Boundaries { contract, bundle } => {
            let c = load(&contract)?;
            print_json(&c.restorable_boundaries(&read_json(&bundle)?)?)
        }
        Command::Common {
            contract,
            bundles: paths,
        } => {
            let c = load(&contract)?;
            print_json(&c.common_restorable(&bundles(&paths)?)?)
        }
        Command::Select {
            contract,
            bundles: paths,
            prompt_len,
        } => {
            let c = load(&contract)?;
            let common = c.common_restorable(&bundles(&paths)?)?;
            print_json(&select_boundary(&common, prompt_limit(prompt_len)))
        }
    }
}
