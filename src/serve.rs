//! `orbitkv serve`: the manager (the `orbitkv-manager` crate) under this
//! process's signals.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use anyhow::Result;

pub use orbitkv_manager::Args;

pub fn run(args: Args) -> Result<()> {
    let settings = orbitkv_manager::Settings::from_args(&args)?;
    let stop = Arc::new(AtomicBool::new(false));
    signal_hook::flag::register(signal_hook::consts::SIGTERM, stop.clone())?;
    signal_hook::flag::register(signal_hook::consts::SIGINT, stop.clone())?;
    orbitkv_manager::serve(settings, &stop)?;
    Ok(())
}
