//! The copy agent lives in the engine side (`orbitkv_engine::agent`); here
//! only its refusals become Python exceptions.

pub use orbitkv_engine::agent::*;

/// A refused agent setup as a Python exception: `CudaUnavailable` for
/// CUDA memory this process cannot use, `ValueError` otherwise.
pub fn py_err(e: AgentSetup) -> pyo3::PyErr {
    match e {
        AgentSetup::Cuda(e) => crate::CudaUnavailable::new_err(e.to_string()),
        e => pyo3::exceptions::PyValueError::new_err(e.to_string()),
    }
}
