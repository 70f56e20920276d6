//! Coalescing a batch into contiguous runs: one driver copy per run instead
//! of one per page.

use super::driver::{Ordinal, Run};

/// One validated copy in absolute addresses, with the device it targets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Resolved {
    pub device: Ordinal,
    pub run: Run,
}

/// Appends `copies` to `out` as runs, in submission order: a copy that
/// continues the previous one in both host and device address space (same
/// device) extends it. Order is kept, so copies whose destinations overlap
/// land as they would one by one. Empty copies are dropped.
pub(crate) fn coalesce(copies: impl IntoIterator<Item = Resolved>, out: &mut Vec<Resolved>) {
    for next in copies {
        if next.run.len == 0 {
            continue;
        }
        if let Some(last) = out.last_mut() {
            let host_end = last.run.host.checked_add(last.run.len);
            let device_end = last.run.device.checked_add(last.run.len);
            if last.device == next.device
                && host_end == Some(next.run.host)
                && device_end == Some(next.run.device)
            {
                // Cannot overflow: both ends were just computed without
                // overflow, and `next` is a validated range after them.
                last.run.len += next.run.len;
                continue;
            }
        }
        out.push(next);
    }
}

/// The devices `runs` touch, in order of first appearance.
pub(crate) fn devices(runs: &[Resolved], out: &mut Vec<Ordinal>) {
    out.clear();
    for r in runs {
        if !out.contains(&r.device) {
            out.push(r.device);
        }
    }
}
