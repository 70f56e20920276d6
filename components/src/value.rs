//! Canonical key/value data for identity inputs.
//!
//! Adapters hand OrbitKV their computation settings, cache representation and
//! model configuration as JSON-like maps. [`CanonicalValue`] is that data with
//! one byte encoding per value: object keys are sorted, duplicate keys are a
//! parse error (plain `serde_json::Value` silently keeps the last one), and the
//! encoding is self-delimiting:
//!
//! ```text
//! null   := 0x00
//! false  := 0x01            true := 0x02
//! uint   := 0x03 ‖ u64       (non-negative integers)
//! int    := 0x04 ‖ i64       (negative integers)
//! float  := 0x05 ‖ f64 bits  (finite; `1.0` and `1` are different values)
//! string := 0x06 ‖ len:u64 ‖ utf8
//! array  := 0x07 ‖ count:u64 ‖ value*
//! object := 0x08 ‖ count:u64 ‖ (len:u64 ‖ key ‖ value)*   keys in byte order
//! ```

use std::collections::BTreeMap;
use std::fmt;

use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::ser::{SerializeMap, SerializeSeq, Serializer};
use serde::{Deserialize, Serialize};

use crate::encoding::{put_str, put_u64};

/// A JSON value with exactly one canonical encoding.
#[derive(Debug, Clone, PartialEq)]
pub enum CanonicalValue {
    Null,
    Bool(bool),
    UInt(u64),
    Int(i64),
    Float(f64),
    String(String),
    Array(Vec<CanonicalValue>),
    Object(BTreeMap<String, CanonicalValue>),
}

/// A canonical key/value map (an object at the top level).
pub type CanonicalMap = BTreeMap<String, CanonicalValue>;

impl CanonicalValue {
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        match self {
            CanonicalValue::Null => out.push(0x00),
            CanonicalValue::Bool(false) => out.push(0x01),
            CanonicalValue::Bool(true) => out.push(0x02),
            CanonicalValue::UInt(v) => {
                out.push(0x03);
                put_u64(out, *v);
            }
            CanonicalValue::Int(v) => {
                out.push(0x04);
                out.extend_from_slice(&v.to_le_bytes());
            }
            CanonicalValue::Float(v) => {
                out.push(0x05);
                out.extend_from_slice(&v.to_bits().to_le_bytes());
            }
            CanonicalValue::String(s) => {
                out.push(0x06);
                put_str(out, s);
            }
            CanonicalValue::Array(items) => {
                out.push(0x07);
                put_u64(out, items.len() as u64);
                for item in items {
                    item.encode_into(out);
                }
            }
            CanonicalValue::Object(map) => encode_map_into(map, out),
        }
    }

    /// The first path (`a.b[3]`) holding a `null`, if any. Identity inputs use
    /// `null` to mean "could not be established", which must fail closed.
    pub fn find_null(&self) -> Option<String> {
        match self {
            CanonicalValue::Null => Some(String::new()),
            CanonicalValue::Array(items) => items
                .iter()
                .enumerate()
                .find_map(|(i, v)| v.find_null().map(|p| format!("[{i}]{p}"))),
            CanonicalValue::Object(map) => find_null_in_map(map),
            _ => None,
        }
    }
}

pub fn encode_map_into(map: &CanonicalMap, out: &mut Vec<u8>) {
    out.push(0x08);
    put_u64(out, map.len() as u64);
    for (k, v) in map {
        put_str(out, k);
        v.encode_into(out);
    }
}

pub fn encode_map(map: &CanonicalMap) -> Vec<u8> {
    let mut out = Vec::new();
    encode_map_into(map, &mut out);
    out
}

pub fn find_null_in_map(map: &CanonicalMap) -> Option<String> {
    map.iter().find_map(|(k, v)| {
        v.find_null().map(|p| {
            if p.is_empty() || p.starts_with('[') {
                format!("{k}{p}")
            } else {
                format!("{k}.{p}")
            }
        })
    })
}

impl Serialize for CanonicalValue {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            CanonicalValue::Null => s.serialize_unit(),
            CanonicalValue::Bool(b) => s.serialize_bool(*b),
            CanonicalValue::UInt(v) => s.serialize_u64(*v),
            CanonicalValue::Int(v) => s.serialize_i64(*v),
            CanonicalValue::Float(v) => s.serialize_f64(*v),
            CanonicalValue::String(v) => s.serialize_str(v),
            CanonicalValue::Array(items) => {
                let mut seq = s.serialize_seq(Some(items.len()))?;
                for item in items {
                    seq.serialize_element(item)?;
                }
                seq.end()
            }
            CanonicalValue::Object(map) => {
                let mut m = s.serialize_map(Some(map.len()))?;
                for (k, v) in map {
                    m.serialize_entry(k, v)?;
                }
                m.end()
            }
        }
    }
}

struct ValueVisitor;

impl<'de> Visitor<'de> for ValueVisitor {
    type Value = CanonicalValue;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(CanonicalValue::Null)
    }
    fn visit_none<E>(self) -> Result<Self::Value, E> {
        Ok(CanonicalValue::Null)
    }
    fn visit_bool<E>(self, v: bool) -> Result<Self::Value, E> {
        Ok(CanonicalValue::Bool(v))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Self::Value, E> {
        Ok(CanonicalValue::UInt(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Self::Value, E> {
        Ok(if v >= 0 {
            CanonicalValue::UInt(v as u64)
        } else {
            CanonicalValue::Int(v)
        })
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
        if v.is_finite() {
            Ok(CanonicalValue::Float(v))
        } else {
            Err(E::custom("non-finite number"))
        }
    }
    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        Ok(CanonicalValue::String(v.to_owned()))
    }
    fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
        Ok(CanonicalValue::String(v))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element()? {
            items.push(item);
        }
        Ok(CanonicalValue::Array(items))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut access: A) -> Result<Self::Value, A::Error> {
        let mut map = BTreeMap::new();
        while let Some((key, value)) = access.next_entry::<String, CanonicalValue>()? {
            if map.contains_key(&key) {
                return Err(de::Error::custom(format!("duplicate key `{key}`")));
            }
            map.insert(key, value);
        }
        Ok(CanonicalValue::Object(map))
    }
}

impl<'de> Deserialize<'de> for CanonicalValue {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ValueVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn enc(json: &str) -> Vec<u8> {
        let v: CanonicalValue = serde_json::from_str(json).unwrap();
        let mut out = Vec::new();
        v.encode_into(&mut out);
        out
    }

    #[test]
    fn key_order_does_not_matter() {
        assert_eq!(
            enc(r#"{"a":1,"b":[true,null]}"#),
            enc(r#"{"b":[true,null],"a":1}"#)
        );
    }

    #[test]
    fn integer_and_float_are_distinct() {
        assert_ne!(enc("1"), enc("1.0"));
        assert_ne!(enc("-1"), enc("18446744073709551615"));
        assert_ne!(enc(r#""1""#), enc("1"));
    }

    #[test]
    fn nesting_is_unambiguous() {
        assert_ne!(enc(r#"[[1],2]"#), enc(r#"[[1,2]]"#));
        assert_ne!(enc(r#"{"a":{"b":1}}"#), enc(r#"{"a.b":1}"#));
    }

    #[test]
    fn exact_bytes() {
        let mut expected = vec![0x08];
        expected.extend_from_slice(&1u64.to_le_bytes());
        expected.extend_from_slice(&1u64.to_le_bytes());
        expected.push(b'k');
        expected.push(0x03);
        expected.extend_from_slice(&7u64.to_le_bytes());
        assert_eq!(enc(r#"{"k":7}"#), expected);
    }

    #[test]
    fn duplicate_keys_are_rejected() {
        let err = serde_json::from_str::<CanonicalValue>(r#"{"a":1,"a":2}"#).unwrap_err();
        assert!(err.to_string().contains("duplicate key `a`"), "{err}");
    }

    #[test]
    fn null_paths_are_found() {
        let v: CanonicalValue = serde_json::from_str(r#"{"a":{"b":[1,null]},"c":2}"#).unwrap();
        assert_eq!(v.find_null().as_deref(), Some("a.b[1]"));
        let v: CanonicalValue = serde_json::from_str(r#"{"a":2}"#).unwrap();
        assert_eq!(v.find_null(), None);
    }
}
