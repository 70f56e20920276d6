//! The recovery contract functions of `orbitkv_components::contract`, on the
//! contract and bundle JSON of `docs/contract.md`.

use orbitkv_components::{
    ContractSpec, Namespace, RecoveryContract, StateBundle, prompt_limit, select_boundary as select,
};
use pyo3::prelude::*;

use crate::ContractError;
use crate::convert::deserialize_dict;

fn error(e: impl std::fmt::Display) -> PyErr {
    ContractError::new_err(e.to_string())
}

fn compile(contract: &Bound<'_, PyAny>) -> PyResult<RecoveryContract> {
    let spec: ContractSpec =
        deserialize_dict(contract).map_err(|e| ContractError::new_err(format!("contract: {e}")))?;
    RecoveryContract::compile(&spec).map_err(error)
}

fn bundle(obj: &Bound<'_, PyAny>) -> PyResult<StateBundle> {
    deserialize_dict(obj).map_err(|e| ContractError::new_err(format!("bundle: {e}")))
}

/// `(group, start, end)` for every registered group, in group order.
#[pyfunction]
#[pyo3(signature = (contract, start, end, namespace=None))]
pub fn required_ranges(
    contract: &Bound<'_, PyAny>,
    start: u64,
    end: u64,
    namespace: Option<&str>,
) -> PyResult<Vec<(u32, u64, u64)>> {
    let c = compile(contract)?;
    let ns = match namespace {
        None => c.namespace(),
        Some(s) => s
            .parse::<Namespace>()
            .map_err(|e| ContractError::new_err(format!("namespace: {e}")))?,
    };
    Ok(c.required_ranges(ns, start, end)
        .map_err(error)?
        .into_iter()
        .map(|r| (r.group, r.start, r.end))
        .collect())
}

/// Every legal boundary of one rank's bundle, ascending.
#[pyfunction]
pub fn restorable_boundaries(
    contract: &Bound<'_, PyAny>,
    bundle: &Bound<'_, PyAny>,
) -> PyResult<Vec<u64>> {
    let c = compile(contract)?;
    c.restorable_boundaries(&self::bundle(bundle)?)
        .map_err(error)
}

/// The boundaries legal on every rank (one bundle per rank).
#[pyfunction]
pub fn common_boundaries(
    contract: &Bound<'_, PyAny>,
    bundles: Vec<Bound<'_, PyAny>>,
) -> PyResult<Vec<u64>> {
    let c = compile(contract)?;
    let ranks = bundles
        .iter()
        .map(|b| bundle(b))
        .collect::<PyResult<Vec<_>>>()?;
    c.common_restorable(&ranks).map_err(error)
}

/// The largest common boundary a prompt of `prompt_len` tokens may restore
/// to (at most `prompt_len - 1`), or `None`.
#[pyfunction]
pub fn select_boundary(common: Vec<u64>, prompt_len: u64) -> Option<u64> {
    select(&common, prompt_limit(prompt_len))
}

/// Past tokens a vLLM sliding window of `window` tokens keeps (`window - 1`).
#[pyfunction]
pub fn vllm_window_past_tokens(window: u64) -> PyResult<u64> {
    orbitkv_components::vllm_window_past_tokens(window).map_err(error)
}
