//! `orbitkv replay [TRACE]`: run a trace on simulated backends and print the
//! report. Without a trace, the embedded default scenario runs.

use std::path::PathBuf;

use anyhow::{Context as _, Result};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// The main job's embedded default.
pub const DEFAULT_TRACE: &str = include_str!("../scenarios/corpus/multi_turn_chat.jsonl");

#[derive(clap::Args)]
pub struct Args {
    /// Trace file (JSONL, see docs/trace-format.md); default: an embedded
    /// multi-turn chat scenario.
    trace: Option<PathBuf>,
    /// Print the machine-readable report (docs/report-format.md).
    #[arg(long)]
    json: bool,
    /// Draw hit rate, tier occupancy and in-flight bytes over time.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,
}

pub fn run(args: Args) -> Result<()> {
    let text = match &args.trace {
        Some(p) => std::fs::read_to_string(p).with_context(|| format!("{}", p.display()))?,
        None => DEFAULT_TRACE.to_owned(),
    };
    let trace = orbitkv_scenarios::trace::parse(&text, 20).map_err(|errors| {
        let lines: Vec<String> = errors.iter().map(|e| e.to_string()).collect();
        anyhow::anyhow!("{} bad trace line(s): {}", errors.len(), lines.join("; "))
    })?;
    let bar =
        ProgressBar::with_draw_target(Some(trace.lines.len() as u64), ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template("replaying {bar:40} {pos}/{len} lines {elapsed}")
            .expect("static template"),
    );
    let replay = orbitkv_scenarios::replay::Replay::new(&trace.header)?;
    let (report, samples) = replay.run(&trace, &mut |done, _| bar.set_position(done as u64))?;
    bar.finish_and_clear();
    if let Some(path) = &args.plot {
        orbitkv_scenarios::plot::draw(path, &report.trace, &samples)
            .with_context(|| format!("{}", path.display()))?;
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", report.render_text());
    }
    if report.invariant_violations > 0 || report.byte_mismatches > 0 {
        return Err(crate::Findings(format!(
            "{} invariant violation(s), {} byte mismatch(es)",
            report.invariant_violations, report.byte_mismatches
        ))
        .into());
    }
    Ok(())
}
