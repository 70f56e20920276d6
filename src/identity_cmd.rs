//! `orbitkv identity`: compute a computation identity and its namespace, the
//! way an adapter does at startup, and show what went into it.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use anyhow::{Context as _, Result, bail};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use orbitkv_components::identity::InputSummary;
use orbitkv_components::value::CanonicalMap;
use orbitkv_components::{GroupSpec, IdentityInputs, StorageLayout, seal};
use serde::{Deserialize, Serialize};

use crate::read_json;

#[derive(clap::Args)]
pub struct Args {
    /// Model directory: its config.json always participates; its artifacts
    /// are hashed unless a hub revision or ORBITKV_MODEL_FINGERPRINT is given.
    #[arg(long)]
    model_dir: PathBuf,
    /// Settings file (see docs/identity.md).
    #[arg(long)]
    settings: PathBuf,
    /// Full 40-hex hub commit the model directory was downloaded at.
    #[arg(long)]
    hub_revision: Option<String>,
    /// Engine name; overrides the settings file.
    #[arg(long)]
    engine: Option<String>,
    /// Engine release; overrides the settings file.
    #[arg(long)]
    engine_version: Option<String>,
}

/// The settings file an adapter (or an operator reproducing one) writes.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SettingsFile {
    engine: Option<String>,
    engine_version: Option<String>,
    settings: CanonicalMap,
    representation: CanonicalMap,
    #[serde(default)]
    config_overrides: CanonicalMap,
    #[serde(default)]
    active_adapters: Vec<String>,
    layout: StorageLayout,
    /// The cache groups' shapes (id, rule, component kinds): sealed with
    /// the layout.
    groups: Vec<GroupSpec>,
}

#[derive(Serialize)]
struct Report {
    namespace: String,
    identity: String,
    inputs: Vec<InputSummary>,
    layout_slots: usize,
    files_hashed: usize,
    bytes_hashed: u64,
    seconds: f64,
    mb_per_s: f64,
}

pub fn run(args: Args) -> Result<()> {
    let file: SettingsFile = read_json(&args.settings)?;
    let Some(engine) = args.engine.or(file.engine) else {
        bail!(
            "no engine: pass --engine or set \"engine\" in {}",
            args.settings.display()
        );
    };
    let Some(engine_release) = args.engine_version.or(file.engine_version) else {
        bail!(
            "no engine release: pass --engine-version or set \"engine_version\" in {}",
            args.settings.display()
        );
    };
    let inputs = IdentityInputs {
        engine,
        engine_release,
        model_dir: args.model_dir,
        hub_revision: args.hub_revision,
        config_overrides: file.config_overrides,
        settings: file.settings,
        representation: file.representation,
        active_adapters: file.active_adapters,
        ..Default::default()
    }
    .with_process_env()?;

    let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template("hashing model artifacts {bytes} ({bytes_per_sec}) {elapsed}")
            .expect("static template"),
    );
    let hashed = AtomicU64::new(0);
    let started = Instant::now();
    let resolved = inputs.resolve(&|n| {
        hashed.fetch_add(n, Ordering::Relaxed);
        bar.inc(n);
    })?;
    let seconds = started.elapsed().as_secs_f64();
    bar.finish_and_clear();
    let namespace =
        seal(&resolved.digest, &file.layout, &file.groups).context("storage layout and groups")?;
    let bytes_hashed = hashed.load(Ordering::Relaxed);
    let report = Report {
        namespace: namespace.to_hex(),
        identity: hex::encode(resolved.digest),
        inputs: resolved.summary(),
        layout_slots: file.layout.slots.len(),
        files_hashed: resolved.fingerprint.as_ref().map_or(0, |f| f.files.len()),
        bytes_hashed,
        seconds,
        mb_per_s: if seconds > 0.0 {
            bytes_hashed as f64 / 1e6 / seconds
        } else {
            0.0
        },
    };
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}
