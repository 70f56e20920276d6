//! `compute_identity`: what an adapter computes at startup (the identity and,
//! with a layout and its groups, the sealed namespace), as `orbitkv
//! identity` prints it.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

use orbitkv_components::value::CanonicalMap;
use orbitkv_components::{GroupSpec, IdentityInputs, StorageLayout, seal};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::IdentityError;
use crate::convert::{deserialize, deserialize_dict, serialize};

fn map(field: &str, obj: &Bound<'_, PyAny>) -> PyResult<CanonicalMap> {
    deserialize_dict(obj).map_err(|e| IdentityError::new_err(format!("{field}: {e}")))
}

#[pyfunction]
#[pyo3(signature = (
    model_dir, *, engine, engine_version, settings, representation,
    config_overrides=None, hub_revision=None, active_adapters=None, layout=None, groups=None,
))]
#[allow(clippy::too_many_arguments)]
pub fn compute_identity<'py>(
    py: Python<'py>,
    model_dir: PathBuf,
    engine: String,
    engine_version: String,
    settings: &Bound<'py, PyAny>,
    representation: &Bound<'py, PyAny>,
    config_overrides: Option<&Bound<'py, PyAny>>,
    hub_revision: Option<String>,
    active_adapters: Option<Vec<String>>,
    layout: Option<&Bound<'py, PyAny>>,
    groups: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyDict>> {
    let config_overrides = match config_overrides {
        Some(o) if !o.is_none() => map("config_overrides", o)?,
        _ => CanonicalMap::new(),
    };
    let layout: Option<StorageLayout> = match layout {
        Some(l) if !l.is_none() => {
            Some(deserialize_dict(l).map_err(|e| IdentityError::new_err(format!("layout: {e}")))?)
        }
        _ => None,
    };
    let groups: Option<Vec<GroupSpec>> = match groups {
        Some(g) if !g.is_none() => {
            Some(deserialize(g).map_err(|e| IdentityError::new_err(format!("groups: {e}")))?)
        }
        _ => None,
    };
    // Checked before the (possibly long) hashing: a namespace needs both.
    let sealed = match (layout, groups) {
        (Some(l), Some(g)) => Some((l, g)),
        (None, None) => None,
        (Some(_), None) => {
            return Err(IdentityError::new_err(
                "groups: a layout is sealed with its groups' shapes; pass groups",
            ));
        }
        (None, Some(_)) => {
            return Err(IdentityError::new_err(
                "layout: groups are sealed with a layout; pass layout",
            ));
        }
    };
    let inputs = IdentityInputs {
        engine,
        engine_release: engine_version,
        model_dir,
        hub_revision,
        config_overrides,
        settings: map("settings", settings)?,
        representation: map("representation", representation)?,
        active_adapters: active_adapters.unwrap_or_default(),
        ..Default::default()
    };
    // Hashing a model directory reads every weight file: no GIL meanwhile.
    let hashed = AtomicU64::new(0);
    let resolved = py
        .detach(|| {
            inputs.with_process_env()?.resolve(&|n| {
                hashed.fetch_add(n, Ordering::Relaxed);
            })
        })
        .map_err(|e| IdentityError::new_err(e.to_string()))?;
    let namespace = match &sealed {
        Some((l, g)) => Some(
            seal(&resolved.digest, l, g)
                .map_err(|e| IdentityError::new_err(format!("layout: {e}")))?
                .to_hex(),
        ),
        None => None,
    };
    let out = PyDict::new(py);
    out.set_item("identity", hex::encode(resolved.digest))?;
    out.set_item("namespace", namespace)?;
    out.set_item("inputs", serialize(py, &resolved.summary())?)?;
    out.set_item("bytes_hashed", hashed.load(Ordering::Relaxed))?;
    Ok(out)
}
