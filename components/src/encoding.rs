//! Canonical, versioned, domain-separated, length-framed encoding.
//!
//! Everything OrbitKV hashes into an identity goes through [`Frame`], so two
//! inputs can only produce the same bytes when they are the same value. The
//! layout (all integers little-endian):
//!
//! ```text
//! frame   := domain_len:u32 ‖ domain:ascii ‖ version:u16 ‖ field*
//! field   := field_id:u16 ‖ body_len:u64 ‖ body
//! ```
//!
//! Field ids are written in strictly increasing order; a reader that sees the
//! same domain and version knows exactly which body belongs to which input.

use sha2::{Digest as _, Sha256};

/// A 32-byte SHA-256 digest.
pub type Digest32 = [u8; 32];

/// Builder for one canonical frame.
#[derive(Debug, Clone)]
pub struct Frame {
    bytes: Vec<u8>,
    last_field: Option<u16>,
}

impl Frame {
    pub fn new(domain: &str, version: u16) -> Self {
        debug_assert!(domain.is_ascii());
        let mut bytes = Vec::with_capacity(64 + domain.len());
        bytes.extend_from_slice(&(domain.len() as u32).to_le_bytes());
        bytes.extend_from_slice(domain.as_bytes());
        bytes.extend_from_slice(&version.to_le_bytes());
        Frame {
            bytes,
            last_field: None,
        }
    }

    /// Appends one field. Ids must increase: a frame has exactly one order.
    pub fn field(&mut self, id: u16, body: &[u8]) -> &mut Self {
        assert!(
            self.last_field.is_none_or(|last| last < id),
            "frame field ids must strictly increase ({id} after {:?})",
            self.last_field
        );
        self.last_field = Some(id);
        self.bytes.extend_from_slice(&id.to_le_bytes());
        self.bytes
            .extend_from_slice(&(body.len() as u64).to_le_bytes());
        self.bytes.extend_from_slice(body);
        self
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes
    }

    pub fn into_bytes(self) -> Vec<u8> {
        self.bytes
    }

    pub fn sha256(&self) -> Digest32 {
        sha256(&self.bytes)
    }
}

/// Whether two byte arrays are equal, compared as 8-byte words: stays
/// inline and branch-free, where `==` on `[u8; N]` becomes a `memcmp` call
/// (a third of a key lookup's cost in discovery).
pub fn eq_words<const N: usize>(a: &[u8; N], b: &[u8; N]) -> bool {
    let word = |c: &[u8]| {
        let mut w = [0u8; 8];
        w.copy_from_slice(c);
        u64::from_ne_bytes(w)
    };
    let (xa, xb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail = xa.remainder() == xb.remainder();
    xa.zip(xb).fold(0u64, |d, (x, y)| d | (word(x) ^ word(y))) == 0 && tail
}

pub fn sha256(bytes: &[u8]) -> Digest32 {
    Sha256::digest(bytes).into()
}

/// Appends a length-prefixed UTF-8 string (`len:u64 ‖ bytes`).
pub fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

pub fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

pub fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

/// Serde helper: a digest as lowercase hex.
pub fn serialize_hex<S: serde::Serializer>(d: &Digest32, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&hex::encode(d))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eq_words_agrees_with_byte_equality_at_every_position() {
        let a = [0x5au8; 64];
        assert!(eq_words(&a, &a));
        for i in 0..64 {
            let mut b = a;
            b[i] ^= 1;
            assert!(!eq_words(&a, &b), "byte {i}");
        }
        // A length that is not a multiple of 8 compares its tail too.
        let c = [3u8; 13];
        let mut d = c;
        d[12] = 4;
        assert!(eq_words(&c, &c) && !eq_words(&c, &d));
    }

    #[test]
    fn frame_bytes_are_exact() {
        let mut f = Frame::new("ab", 3);
        f.field(1, b"xy").field(7, b"");
        let expected: Vec<u8> = [
            &2u32.to_le_bytes()[..],
            b"ab",
            &3u16.to_le_bytes(),
            &1u16.to_le_bytes(),
            &2u64.to_le_bytes(),
            b"xy",
            &7u16.to_le_bytes(),
            &0u64.to_le_bytes(),
        ]
        .concat();
        assert_eq!(f.as_bytes(), &expected[..]);
    }

    #[test]
    fn framing_separates_field_boundaries() {
        // "ab"+"c" and "a"+"bc" must not collide.
        let mut a = Frame::new("d", 1);
        a.field(1, b"ab").field(2, b"c");
        let mut b = Frame::new("d", 1);
        b.field(1, b"a").field(2, b"bc");
        assert_ne!(a.sha256(), b.sha256());
        // Domains separate otherwise equal content.
        let mut c = Frame::new("e", 1);
        c.field(1, b"ab").field(2, b"c");
        assert_ne!(a.sha256(), c.sha256());
    }

    #[test]
    #[should_panic(expected = "strictly increase")]
    fn out_of_order_fields_are_a_bug() {
        Frame::new("d", 1).field(2, b"").field(1, b"");
    }
}
