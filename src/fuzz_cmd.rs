//! `orbitkv fuzz`: random scenarios with faults, checked by invariants and a
//! false-hit oracle; failing seeds are minimized into replayable traces.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context as _, Result};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use orbitkv_scenarios::fuzz::{Verdict, run_seed};

#[derive(clap::Args)]
pub struct Args {
    /// First seed.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Simulated manager ticks per scenario.
    #[arg(long, default_value_t = 2000)]
    ticks: u64,
    /// Number of seeds, from --seed on.
    #[arg(long, default_value_t = 1)]
    seeds: u64,
    /// Where minimized failing traces go.
    #[arg(long, default_value = ".")]
    out: PathBuf,
    /// Also write every generated scenario to DIR (to replay or study).
    #[arg(long, value_name = "DIR")]
    emit: Option<PathBuf>,
}

pub fn run(args: Args) -> Result<()> {
    let bar = ProgressBar::with_draw_target(Some(args.seeds), ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template("fuzzing {bar:40} {pos}/{len} seeds {elapsed} {msg}")
            .expect("static template"),
    );
    let started = Instant::now();
    let (mut ticks, mut failures) = (0u64, Vec::new());
    for seed in args.seed..args.seed.saturating_add(args.seeds) {
        if let Some(dir) = &args.emit {
            let (header, lines) = orbitkv_scenarios::fuzz::generate(seed, args.ticks);
            let path = dir.join(format!("fuzz-{seed}.jsonl"));
            std::fs::write(&path, orbitkv_scenarios::trace::render(&header, &lines))
                .with_context(|| format!("{}", path.display()))?;
        }
        let result = run_seed(seed, args.ticks);
        match &result.verdict {
            Verdict::Clean { ticks: t } => ticks += t,
            Verdict::Failed { why, ticks: t } => {
                ticks += t;
                let path = args.out.join(format!("fuzz-failure-{seed}.jsonl"));
                if let Some(trace) = &result.minimized {
                    std::fs::write(&path, trace).with_context(|| format!("{}", path.display()))?;
                }
                bar.suspend(|| {
                    eprintln!("seed {seed} FAILED: {why}");
                    eprintln!(
                        "  minimized trace: {} (run: orbitkv replay {})",
                        path.display(),
                        path.display()
                    );
                });
                failures.push(seed);
            }
        }
        bar.inc(1);
        bar.set_message(format!("{} failing", failures.len()));
    }
    bar.finish_and_clear();
    let secs = started.elapsed().as_secs_f64();
    println!(
        "{} seed(s) x {} ticks: {} clean, {} failed; {} ticks in {:.1} s ({:.0} ticks/s)",
        args.seeds,
        args.ticks,
        args.seeds - failures.len() as u64,
        failures.len(),
        ticks,
        secs,
        ticks as f64 / secs.max(1e-9)
    );
    if !failures.is_empty() {
        return Err(crate::Findings(format!("failing seeds: {failures:?}")).into());
    }
    Ok(())
}
