//! The bridge's copy agent: one `orbitkv_gpu::agent::CopyAgent` per
//! `Client` (or embedded `Runtime`), on the host executor (memcpy worker
//! threads, so copies run off the Python thread). Engine memory is attached
//! to it (`attach_agent_memory`), registered with the manager as an
//! agent-owned region, and copied here on the manager's instruction; the
//! manager never maps it.

use std::os::fd::AsFd;
use std::os::unix::fs::MetadataExt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use orbitkv_components::api::{Command, Event};
use orbitkv_gpu::agent::{Chunk, CopyAgent, HostWindow, MemoryKind};
use orbitkv_gpu::host::{HostCopyConfig, HostCopyEngine};

/// How long a lost connection waits for running copies before reporting.
pub const DRAIN: Duration = Duration::from_secs(10);

/// The agent and the staging area its window maps (device and inode).
pub struct AgentState {
    pub agent: CopyAgent,
    staging: Option<(u64, u64)>,
}

/// A copy agent shared by its owner (which attaches memory) and the
/// connection (which feeds it events and sends its reports).
#[derive(Clone)]
pub struct SharedAgent(Arc<Mutex<AgentState>>);

impl SharedAgent {
    pub fn host(workers: usize) -> Self {
        let executor = HostCopyEngine::new(HostCopyConfig {
            workers: workers.max(1),
            max_in_flight_batches: 64,
            shared_regions: false,
        });
        SharedAgent(Arc::new(Mutex::new(AgentState {
            agent: CopyAgent::new(Box::new(executor)),
            staging: None,
        })))
    }

    pub fn lock(&self) -> MutexGuard<'_, AgentState> {
        // A panic while locked leaves plain bookkeeping behind.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Host chunks from `(data_ptr, stride, length)` triples; `device` must be
/// `"cpu"` (the only executor of this build).
pub fn host_chunks(chunks: Vec<(u64, u64, u64)>, device: &str) -> Result<Vec<Chunk>, String> {
    if device != "cpu" {
        return Err(format!(
            "agent memory on {device:?}: only host memory (\"cpu\") has an executor in this build"
        ));
    }
    Ok(chunks
        .into_iter()
        .map(|(ptr, stride, len)| Chunk {
            kind: MemoryKind::Host,
            ptr,
            stride,
            len,
        })
        .collect())
}

fn inode(file: &std::fs::File) -> Option<(u64, u64)> {
    file.metadata().ok().map(|m| (m.dev(), m.ino()))
}

impl orbitkv_ipc::Agent for SharedAgent {
    fn window(
        &mut self,
        pool: &std::fs::File,
        pool_len: u64,
        staging: std::fs::File,
        staging_len: u64,
    ) -> Result<(), String> {
        let mut st = self.lock();
        let id = inode(&staging);
        // Sent with every agent region: the same area needs no new window.
        if st.agent.has_window() && id.is_some() && st.staging == id {
            return Ok(());
        }
        let window = HostWindow::map(pool.as_fd(), pool_len, staging.as_fd(), staging_len)
            .map_err(|e| e.to_string())?;
        st.agent.set_window(window).map_err(|e| e.to_string())?;
        st.staging = id;
        Ok(())
    }

    fn take(&mut self, event: &Event) -> bool {
        matches!(event, Event::AgentCopy { .. }) && self.lock().agent.handle(event)
    }

    fn reports(&mut self, out: &mut Vec<Command>) {
        self.lock().agent.poll(out);
    }

    fn busy(&self) -> bool {
        self.lock().agent.busy()
    }

    fn lost(&mut self) {
        // The manager has already failed these copies; what matters is
        // that none still writes engine memory when the caller hears of it.
        let mut discard = Vec::new();
        self.lock().agent.drain(DRAIN, &mut discard);
    }
}
