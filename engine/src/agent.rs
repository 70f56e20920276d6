//! The engine's copy agent: one `orbitkv_gpu::agent::CopyAgent` per
//! connection (or embedded runtime). Engine memory is attached to it
//! (`attach_agent_memory`), registered with the manager as an agent-owned
//! region, and copied here on the manager's instruction; the manager never
//! maps it.
//!
//! The agent's executor follows the memory it is created for: host memory
//! (`device="cpu"`) gets the host executor (memcpy worker threads, so
//! copies run off the Python thread); CUDA memory (`device="cuda:N"`,
//! from `tensor.data_ptr()`, `tensor.device.index` and the tensor's byte
//! size) gets the CUDA executor (`orbitkv_gpu::cuda`), which pins the host
//! window (pool read-only, staging writable) and validates every region
//! against the allocation it lies in. Where this process cannot use CUDA,
//! CUDA memory is refused ([`AgentSetup::Cuda`], `orbitkv.CudaUnavailable`
//! in Python): never a host memcpy on a device pointer. One agent copies
//! one kind of memory; the other kind needs another client.

use std::os::fd::AsFd;
use std::os::unix::fs::MetadataExt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use orbitkv_components::api::{Command, Event};
use orbitkv_gpu::agent::{AgentError, Chunk, CopyAgent, HostWindow, MemoryKind, executor_for};
use orbitkv_gpu::cuda::CudaConfig;
use orbitkv_gpu::host::HostCopyConfig;

/// How long a lost connection waits for running copies before reporting.
pub const DRAIN: Duration = Duration::from_secs(10);

/// The agent and the staging area its window maps (device and inode).
pub struct AgentState {
    pub agent: CopyAgent,
    /// What memory the agent's executor copies.
    pub kind: MemoryKind,
    staging: Option<(u64, u64)>,
}

/// Why agent memory could not be attached.
#[derive(Debug)]
pub enum AgentSetup {
    /// A bad `device` or chunk list (`ValueError`).
    Invalid(String),
    /// CUDA memory in a process that cannot copy to it
    /// (`orbitkv.CudaUnavailable`).
    Cuda(AgentError),
    /// The memory or its layout was refused (`ValueError`).
    Refused(AgentError),
}

impl std::fmt::Display for AgentSetup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AgentSetup::Invalid(m) => f.write_str(m),
            AgentSetup::Cuda(e) | AgentSetup::Refused(e) => write!(f, "{e}"),
        }
    }
}

impl From<AgentError> for AgentSetup {
    fn from(e: AgentError) -> Self {
        match e {
            e @ AgentError::CudaUnavailable { .. } => AgentSetup::Cuda(e),
            e => AgentSetup::Refused(e),
        }
    }
}

/// Executor batches a CUDA agent keeps in flight (and events it creates
/// per device): a layer-wise restore is one batch per layer, so a copy of
/// an 80-layer model alone takes 80.
pub const CUDA_AGENT_BATCHES: usize = 1024;

/// A new agent whose executor copies memory of `kind` (see the module
/// docs); `workers` host copy threads.
pub fn new_agent(kind: MemoryKind, workers: usize) -> Result<CopyAgent, AgentSetup> {
    let host = HostCopyConfig {
        workers: workers.max(1),
        max_in_flight_batches: 64,
        shared_regions: false,
    };
    let cuda = CudaConfig {
        max_in_flight_batches: CUDA_AGENT_BATCHES,
        ..CudaConfig::default()
    };
    Ok(CopyAgent::new(executor_for(kind, host, cuda)?))
}

/// Refuses memory of `kind` for an agent whose executor copies `agent`'s
/// kind.
pub fn check_kind(agent: MemoryKind, kind: MemoryKind) -> Result<(), AgentSetup> {
    let name = |k: MemoryKind| match k {
        MemoryKind::Host => "host memory".to_string(),
        MemoryKind::Cuda { device } => format!("CUDA memory (home device cuda:{device})"),
    };
    match (agent, kind) {
        (MemoryKind::Host, MemoryKind::Host)
        | (MemoryKind::Cuda { .. }, MemoryKind::Cuda { .. }) => Ok(()),
        _ => Err(AgentSetup::Invalid(format!(
            "this connection's copy agent copies {}; {} needs another connection",
            name(agent),
            name(kind)
        ))),
    }
}

/// A copy agent shared by its owner (which attaches memory) and the
/// connection (which feeds it events and sends its reports).
#[derive(Clone)]
pub struct SharedAgent(Arc<Mutex<AgentState>>);

impl SharedAgent {
    pub fn new(kind: MemoryKind, workers: usize) -> Result<Self, AgentSetup> {
        Ok(SharedAgent(Arc::new(Mutex::new(AgentState {
            agent: new_agent(kind, workers)?,
            kind,
            staging: None,
        }))))
    }

    pub fn lock(&self) -> MutexGuard<'_, AgentState> {
        // A panic while locked leaves plain bookkeeping behind.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The memory kind a `device` string names: `"cpu"` or `"cuda:N"` (what
/// `str(tensor.device)` gives for a tensor on CUDA device N).
pub fn memory_kind(device: &str) -> Result<MemoryKind, AgentSetup> {
    if device == "cpu" {
        return Ok(MemoryKind::Host);
    }
    if let Some(n) = device.strip_prefix("cuda:")
        && let Ok(device) = n.parse::<i32>()
        && device >= 0
    {
        return Ok(MemoryKind::Cuda { device });
    }
    Err(AgentSetup::Invalid(format!(
        "agent memory on {device:?}: the device is \"cpu\" or \"cuda:N\" (N the tensor's \
         device index)"
    )))
}

/// Chunks of `kind` from `(data_ptr, stride, length)` triples.
pub fn chunks_of(kind: MemoryKind, chunks: Vec<(u64, u64, u64)>) -> Vec<Chunk> {
    chunks
        .into_iter()
        .map(|(ptr, stride, len)| Chunk {
            kind,
            ptr,
            stride,
            len,
        })
        .collect()
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
