//! [`Namespace`]: the sealed storage identity every `StateKey` lives under.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::encoding::Digest32;

/// A sealed namespace: SHA-256 of the computation identity bound to a storage
/// layout (see [`crate::layout::seal`]). Shown and parsed as 64 lowercase hex
/// digits. The all-zero value is "no namespace" and is never produced by
/// sealing.
// Equality is the derived one, written out to compare words (every key
// lookup compares a namespace); the derived Hash and Ord agree with it.
#[allow(clippy::derived_hash_with_manual_eq)]
#[derive(Clone, Copy, Eq, Hash, PartialOrd, Ord)]
pub struct Namespace(pub Digest32);

impl PartialEq for Namespace {
    fn eq(&self, other: &Self) -> bool {
        crate::encoding::eq_words(&self.0, &other.0)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NamespaceParseError {
    #[error("namespace is empty")]
    Empty,
    #[error("namespace must be 64 lowercase hex digits, got {0:?}")]
    NotHex(String),
}

impl Namespace {
    pub const EMPTY: Namespace = Namespace([0; 32]);

    pub fn is_empty(&self) -> bool {
        self.0 == [0; 32]
    }

    pub fn as_bytes(&self) -> &Digest32 {
        &self.0
    }

    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }
}

impl fmt::Display for Namespace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for Namespace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Namespace({})", &self.to_hex()[..16])
    }
}

/// Parses exactly 64 lowercase hex digits into 32 bytes.
pub fn parse_hex32(s: &str) -> Option<Digest32> {
    if s.len() != 64
        || !s
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    {
        return None;
    }
    let mut out = [0u8; 32];
    hex::decode_to_slice(s, &mut out).ok()?;
    Some(out)
}

impl FromStr for Namespace {
    type Err = NamespaceParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.is_empty() {
            return Err(NamespaceParseError::Empty);
        }
        let bytes = parse_hex32(s).ok_or_else(|| NamespaceParseError::NotHex(s.to_owned()))?;
        let ns = Namespace(bytes);
        if ns.is_empty() {
            return Err(NamespaceParseError::Empty);
        }
        Ok(ns)
    }
}

impl Serialize for Namespace {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_hex())
    }
}

impl<'de> Deserialize<'de> for Namespace {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_round_trip_and_errors() {
        let hex = "ab".repeat(32);
        let ns: Namespace = hex.parse().unwrap();
        assert_eq!(ns.to_string(), hex);
        assert_eq!("".parse::<Namespace>(), Err(NamespaceParseError::Empty));
        assert_eq!(
            "0".repeat(64).parse::<Namespace>(),
            Err(NamespaceParseError::Empty)
        );
        assert!(matches!(
            "AB".repeat(32).parse::<Namespace>(),
            Err(NamespaceParseError::NotHex(_))
        ));
        assert!(matches!(
            "ab".repeat(31).parse::<Namespace>(),
            Err(NamespaceParseError::NotHex(_))
        ));
        assert!(matches!(
            "zz".repeat(32).parse::<Namespace>(),
            Err(NamespaceParseError::NotHex(_))
        ));
    }
}
