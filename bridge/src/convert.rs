//! Python objects ⇄ JSON values.
//!
//! Every structured argument crosses the boundary as the serde JSON shape of
//! the Rust type (the same shape the wire, traces and the CLI use), so a bad
//! dict fails with serde's own message and nothing is converted twice.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Map, Number, Value};

/// Deeper than any command or contract; a self-referential dict stops here
/// instead of overflowing the stack.
const MAX_DEPTH: usize = 128;

/// Converts JSON-like Python data (`dict` with `str` keys, `list`, `tuple`,
/// `str`, `int`, `float`, `bool`, `None`) to a JSON value.
pub fn to_json(obj: &Bound<'_, PyAny>) -> Result<Value, String> {
    to_json_at(obj, 0)
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".to_owned())
}

fn to_json_at(obj: &Bound<'_, PyAny>, depth: usize) -> Result<Value, String> {
    if depth > MAX_DEPTH {
        return Err(format!(
            "value nests deeper than {MAX_DEPTH} levels (is it self-referential?)"
        ));
    }
    if obj.is_none() {
        return Ok(Value::Null);
    }
    // bool before int: Python's bool is an int.
    if let Ok(b) = obj.cast::<PyBool>() {
        return Ok(Value::Bool(b.is_true()));
    }
    if obj.is_instance_of::<PyInt>() {
        return int_value(obj);
    }
    if let Ok(f) = obj.cast::<PyFloat>() {
        let v = f.value();
        return Number::from_f64(v)
            .map(Value::Number)
            .ok_or_else(|| format!("{v} is not a finite number"));
    }
    if let Ok(s) = obj.cast::<PyString>() {
        return s
            .extract::<String>()
            .map(Value::String)
            .map_err(|e| e.to_string());
    }
    if let Ok(d) = obj.cast::<PyDict>() {
        let mut map = Map::new();
        for (k, v) in d.iter() {
            let Ok(key) = k.cast::<PyString>() else {
                return Err(format!("dict keys must be str, got {}", type_name(&k)));
            };
            let key: String = key.extract().map_err(|e: PyErr| e.to_string())?;
            map.insert(key, to_json_at(&v, depth + 1)?);
        }
        return Ok(Value::Object(map));
    }
    if let Ok(l) = obj.cast::<PyList>() {
        return l.iter().map(|v| to_json_at(&v, depth + 1)).collect();
    }
    if let Ok(t) = obj.cast::<PyTuple>() {
        return t.iter().map(|v| to_json_at(&v, depth + 1)).collect();
    }
    // Integer-like scalars that are not `int` (numpy integers): `__index__`.
    if obj.hasattr("__index__").unwrap_or(false) {
        return int_value(obj);
    }
    Err(format!(
        "{} is not JSON data (use dict, list, tuple, str, int, float, bool or None)",
        type_name(obj)
    ))
}

fn int_value(obj: &Bound<'_, PyAny>) -> Result<Value, String> {
    if let Ok(v) = obj.extract::<u64>() {
        return Ok(Value::from(v));
    }
    if let Ok(v) = obj.extract::<i64>() {
        return Ok(Value::from(v));
    }
    Err(format!("integer {obj} does not fit in 64 bits"))
}

/// Converts a JSON value to plain Python data (`dict`, `list`, `str`, `int`,
/// `float`, `bool`, `None`).
pub fn to_py<'py>(py: Python<'py>, value: &Value) -> PyResult<Bound<'py, PyAny>> {
    Ok(match value {
        Value::Null => py.None().into_bound(py),
        Value::Bool(b) => PyBool::new(py, *b).to_owned().into_any(),
        Value::Number(n) => {
            if let Some(u) = n.as_u64() {
                u.into_pyobject(py)?.into_any()
            } else if let Some(i) = n.as_i64() {
                i.into_pyobject(py)?.into_any()
            } else {
                n.as_f64().unwrap_or(f64::NAN).into_pyobject(py)?.into_any()
            }
        }
        Value::String(s) => PyString::new(py, s).into_any(),
        Value::Array(items) => {
            let list = PyList::empty(py);
            for item in items {
                list.append(to_py(py, item)?)?;
            }
            list.into_any()
        }
        Value::Object(map) => {
            let dict = PyDict::new(py);
            for (k, v) in map {
                dict.set_item(k, to_py(py, v)?)?;
            }
            dict.into_any()
        }
    })
}

/// Serializes a Rust value to Python data through its serde JSON shape.
pub fn serialize<'py, T: Serialize>(py: Python<'py>, value: &T) -> PyResult<Bound<'py, PyAny>> {
    let v = serde_json::to_value(value).map_err(|e| PyValueError::new_err(e.to_string()))?;
    to_py(py, &v)
}

/// Deserializes Python data into `T` through its serde JSON shape; the error
/// is serde's message (or why the object is not JSON data).
pub fn deserialize<T: DeserializeOwned>(obj: &Bound<'_, PyAny>) -> Result<T, String> {
    let v = to_json(obj)?;
    serde_json::from_value(v).map_err(|e| e.to_string())
}

/// [`deserialize`] for types whose JSON shape is an object: anything but a
/// `dict` is refused up front (serde would also take a struct or an
/// internally tagged enum from a list of its fields in order).
pub fn deserialize_dict<T: DeserializeOwned>(obj: &Bound<'_, PyAny>) -> Result<T, String> {
    if !obj.is_instance_of::<PyDict>() {
        return Err(format!("expected a dict, got {}", type_name(obj)));
    }
    deserialize(obj)
}
