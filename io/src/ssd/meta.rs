//! Segment files: naming, creation (open + fallocate + directory fsync) and
//! deletion. At run time these metadata syscalls run on one helper thread
//! so that a tick never waits for them; `SsdStore::open` calls the same
//! functions directly.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{Receiver, Sender, TryRecvError, channel};
use std::thread::JoinHandle;

/// `seg-<id as 16 hex digits>.okv`
pub(crate) fn segment_name(id: u64) -> String {
    format!("seg-{id:016x}.okv")
}

/// The largest segment id the store creates or adopts. Ids grow by one per
/// segment, so this is never reached in use; a file named with a larger id
/// was not written by us, and adopting it would make the next id wrap.
pub(crate) const MAX_SEGMENT_ID: u64 = (1 << 63) - 1;

/// The id of a segment file name, `None` for anything else.
pub(crate) fn parse_segment_name(name: &str) -> Option<u64> {
    let hex = name.strip_prefix("seg-")?.strip_suffix(".okv")?;
    if hex.len() != 16 {
        return None;
    }
    u64::from_str_radix(hex, 16).ok()
}

/// fsync of a directory, so that a created or removed entry is durable.
/// Filesystems that cannot sync a directory (EINVAL) are not an error.
pub(crate) fn sync_dir(dir: &Path) -> io::Result<()> {
    let d = File::open(dir)?;
    match d.sync_all() {
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(()),
        r => r,
    }
}

/// Creates a new segment file of `size` bytes (preallocated when the
/// filesystem supports `fallocate`), with the extra open `flags`
/// (O_DIRECT, O_DSYNC), and makes its directory entry durable. On failure
/// nothing is left behind.
pub(crate) fn create_segment(dir: &Path, id: u64, size: u64, flags: i32) -> io::Result<File> {
    let path = dir.join(segment_name(id));
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .custom_flags(flags | libc::O_CLOEXEC)
        .open(&path)?;
    let cleanup = |e: io::Error| {
        let _ = std::fs::remove_file(&path);
        e
    };
    // SAFETY: plain syscall on an fd we own.
    let r = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, size as libc::off_t) };
    if r != 0 {
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS) => {}
            _ => return Err(cleanup(e)),
        }
    }
    sync_dir(dir).map_err(cleanup)?;
    Ok(file)
}

pub(crate) enum MetaReq {
    Create { id: u64, size: u64, flags: i32 },
    Delete { path: PathBuf, file: File },
}

pub(crate) enum MetaDone {
    Created { id: u64, result: io::Result<File> },
    Deleted { result: io::Result<()> },
}

/// The helper thread and its two channels.
pub(crate) struct Meta {
    tx: Option<Sender<MetaReq>>,
    rx: Receiver<MetaDone>,
    handle: Option<JoinHandle<()>>,
    pending: usize,
}

impl Meta {
    pub(crate) fn spawn(dir: PathBuf) -> io::Result<Meta> {
        let (tx, req_rx) = channel::<MetaReq>();
        let (done_tx, rx) = channel::<MetaDone>();
        let handle = std::thread::Builder::new()
            .name("orbitkv-ssd-meta".into())
            .spawn(move || {
                while let Ok(req) = req_rx.recv() {
                    let done = match req {
                        MetaReq::Create { id, size, flags } => MetaDone::Created {
                            id,
                            result: create_segment(&dir, id, size, flags),
                        },
                        MetaReq::Delete { path, file } => {
                            drop(file);
                            let result = std::fs::remove_file(&path).and_then(|()| sync_dir(&dir));
                            MetaDone::Deleted { result }
                        }
                    };
                    if done_tx.send(done).is_err() {
                        return;
                    }
                }
            })?;
        Ok(Meta {
            tx: Some(tx),
            rx,
            handle: Some(handle),
            pending: 0,
        })
    }

    /// Queues a request; `false` if the helper thread is gone.
    pub(crate) fn send(&mut self, req: MetaReq) -> bool {
        match &self.tx {
            Some(tx) if tx.send(req).is_ok() => {
                self.pending += 1;
                true
            }
            _ => false,
        }
    }

    /// Requests sent and not yet answered.
    pub(crate) fn pending(&self) -> usize {
        self.pending
    }

    pub(crate) fn try_recv(&mut self) -> Option<MetaDone> {
        match self.rx.try_recv() {
            Ok(d) => {
                self.pending = self.pending.saturating_sub(1);
                Some(d)
            }
            Err(TryRecvError::Empty) => None,
            Err(TryRecvError::Disconnected) => {
                self.pending = 0;
                None
            }
        }
    }

    /// Blocks for the next answer (drain and `Drop` only).
    pub(crate) fn recv_timeout(&mut self, d: std::time::Duration) -> Option<MetaDone> {
        match self.rx.recv_timeout(d) {
            Ok(x) => {
                self.pending = self.pending.saturating_sub(1);
                Some(x)
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                self.pending = 0;
                None
            }
            Err(_) => None,
        }
    }
}

impl Drop for Meta {
    fn drop(&mut self) {
        // Closing the channel ends the thread after the queued requests.
        self.tx = None;
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert_eq!(segment_name(0x2a), "seg-000000000000002a.okv");
        assert_eq!(parse_segment_name("seg-000000000000002a.okv"), Some(0x2a));
        assert_eq!(parse_segment_name("seg-2a.okv"), None);
        assert_eq!(parse_segment_name("LOCK"), None);
    }
}
