//! Golden vectors: the byte encodings and digests below are part of the
//! on-disk and on-wire format. If one of these tests fails, a format changed:
//! bump its version instead of updating the vector. The identity and
//! namespace digests were cross-checked against an independent Python
//! (hashlib + struct) implementation of the layouts documented in the crate.

use std::collections::BTreeMap;

use orbitkv_components::contract::{ComponentKind, GroupSpec, Rule};
use orbitkv_components::identity::ArtifactIdentity;
use orbitkv_components::value::{CanonicalMap, CanonicalValue};
use orbitkv_components::{
    IdentityParts, KeyError, Namespace, NativeHash, StateFormat, StateKey, StorageLayout,
    StorageSlot, seal,
};

fn ns(byte: u8) -> Namespace {
    Namespace([byte; 32])
}

#[test]
fn state_key_golden_bytes() {
    let key = StateKey::new(ns(0xab), 0, &[0xde, 0xad, 0xbe, 0xef]).unwrap();
    let expected = concat!(
        "01",                                                               // key version
        "abababababababababababababababababababababababababababababababab", // namespace
        "01",                                                               // hash version
        "00000000",                                                         // group 0
        "0400",                                                             // native length
        "deadbeef"
    );
    assert_eq!(hex::encode(key.encode()), expected);
    assert_eq!(
        StateKey::decode(&hex::decode(expected).unwrap()).unwrap(),
        key
    );

    let key = StateKey::new(ns(0x11), 7, &[0x42; 32]).unwrap();
    let expected = format!("01{}01070000002000{}", "11".repeat(32), "42".repeat(32));
    assert_eq!(hex::encode(key.encode()), expected);
    assert_eq!(key.encoded_len(), expected.len() / 2);
    assert_eq!(StateKey::decode(&key.encode()).unwrap(), key);
}

#[test]
fn group_is_part_of_the_key() {
    let a = StateKey::new(ns(1), 0, b"h").unwrap();
    let b = StateKey::new(ns(1), 1, b"h").unwrap();
    assert_ne!(a, b);
    assert_ne!(a.encode(), b.encode());
}

#[test]
fn state_key_decode_rejects_bad_bytes() {
    let good = StateKey::new(ns(3), 2, b"abc").unwrap().encode();
    assert_eq!(StateKey::decode(&good[..10]), Err(KeyError::Truncated(10)));
    let mut v = good.clone();
    v[0] = 2;
    assert_eq!(StateKey::decode(&v), Err(KeyError::KeyVersion(2)));
    let mut v = good.clone();
    v[33] = 9;
    assert_eq!(StateKey::decode(&v), Err(KeyError::HashVersion(9)));
    let mut v = good.clone();
    v.push(0);
    assert_eq!(
        StateKey::decode(&v),
        Err(KeyError::LengthMismatch {
            declared: 3,
            actual: 4
        })
    );
    let mut v = good.clone();
    v[1..33].fill(0);
    assert_eq!(StateKey::decode(&v), Err(KeyError::EmptyNamespace));
    let mut v = good[..40].to_vec();
    v[38] = 0;
    assert_eq!(StateKey::decode(&v), Err(KeyError::EmptyHash));
    assert_eq!(
        StateKey::new(ns(1), 0, &[0; 65]),
        Err(KeyError::HashTooLong(65))
    );
    assert_eq!(
        StateKey::new(Namespace::EMPTY, 0, b"x"),
        Err(KeyError::EmptyNamespace)
    );
}

fn map(pairs: &[(&str, CanonicalValue)]) -> CanonicalMap {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect()
}

pub fn golden_parts() -> IdentityParts {
    IdentityParts {
        engine: "vllm".into(),
        engine_release: "0.33.0".into(),
        artifacts: ArtifactIdentity::HubRevision("0123456789abcdef0123456789abcdef01234567".into()),
        configuration: CanonicalValue::Object(BTreeMap::from([(
            "model_type".to_string(),
            CanonicalValue::String("llama".into()),
        )])),
        config_overrides: CanonicalMap::new(),
        settings: map(&[("dtype", CanonicalValue::String("bfloat16".into()))]),
        representation: map(&[("block_size", CanonicalValue::UInt(16))]),
        cache_scope: None,
    }
}

pub fn golden_slot() -> StorageSlot {
    StorageSlot {
        layer: 0,
        group: 0,
        tp_rank: 0,
        pp_rank: 0,
        segment_bytes: 4096,
        padded_page_bytes: 4096,
        page_tokens: 16,
        dtype: "bfloat16".into(),
        layout: "NHD".into(),
        strides: vec![128, 1],
        device_addr: 0,
    }
}

#[test]
fn identity_and_namespace_golden_digests() {
    let id = golden_parts().digest().unwrap();
    assert_eq!(
        hex::encode(id),
        "1224f2cc2db0d23f9a7984fd87c760a09d3bdfd196fae40f78f9e3ac7c9fb826"
    );
    let layout = StorageLayout {
        slots: vec![golden_slot()],
        pool_capacity_pages: 0,
    };
    let dense = [GroupSpec {
        id: 0,
        rule: Rule::Prefix,
        components: vec![ComponentKind::AttentionKv],
    }];
    assert_eq!(
        seal(&id, &layout, &dense).unwrap().to_hex(),
        "ae985ee6b218b62e33fd4203dc9672daab642e9e6d28f72686cc66f9a8e3d838"
    );
}

/// Full attention, a 31-token window and a recurrent checkpoint (kinds
/// listed out of tag order): pins the group encoding, rule tags, the
/// window and kind tags.
#[test]
fn namespace_golden_digest_with_group_shapes() {
    let id = golden_parts().digest().unwrap();
    let layout = StorageLayout {
        slots: (0..3)
            .map(|g| StorageSlot {
                layer: g,
                group: g,
                ..golden_slot()
            })
            .collect(),
        pool_capacity_pages: 0,
    };
    let groups = |past_tokens| {
        vec![
            GroupSpec {
                id: 2,
                rule: Rule::Checkpoint,
                components: vec![
                    ComponentKind::RecurrentCheckpoint,
                    ComponentKind::ConvolutionState,
                ],
            },
            GroupSpec {
                id: 0,
                rule: Rule::Prefix,
                components: vec![ComponentKind::AttentionKv],
            },
            GroupSpec {
                id: 1,
                rule: Rule::Window { past_tokens },
                components: vec![ComponentKind::SlidingWindowKv],
            },
        ]
    };
    assert_eq!(
        seal(&id, &layout, &groups(31)).unwrap().to_hex(),
        "0499e613ad8a1de56388e23b84d3a675f2dde2a24fd68807a0651df41f057cc5"
    );
    assert_eq!(
        seal(&id, &layout, &groups(63)).unwrap().to_hex(),
        "a4e192b239bdf95c9112a04a5091efc79618da72152bd1d8cebb17c49571577c"
    );
}

#[test]
fn state_format_golden_digest() {
    let f = StateFormat {
        dtype: "bfloat16".into(),
        quantization: "none".into(),
        page_tokens: 16,
        layout: "NHD".into(),
        strides: vec![1024, 128, 1],
        num_kv_heads: 8,
        head_dim: 128,
        tp_rank: 0,
        tp_size: 2,
        pp_rank: 0,
        pp_size: 1,
        implementation: "flash-attn".into(),
    };
    assert_eq!(
        hex::encode(f.digest().unwrap()),
        "3429c1de4a3999b1ff722ab61b56fcd78d026d3315d6510412052ebede029f14"
    );
    let mut other_rank = f.clone();
    other_rank.tp_rank = 1;
    assert_ne!(other_rank.digest().unwrap(), f.digest().unwrap());
    let mut bad = f.clone();
    bad.tp_rank = 2;
    assert!(bad.digest().is_err());
}

/// The key hash reads native hashes in whole words by length class (up to
/// 8, 16, 32 bytes, then the slice): at every class's edges a key and one
/// that differs only in its last used byte are distinct entries with
/// different hashes (every used byte is hashed), and borrowed parts find
/// each.
#[test]
fn key_hash_covers_every_used_byte_of_each_length_class() {
    use orbitkv_components::{KeyHasher, KeyMap, KeyRef};
    use std::hash::BuildHasher;
    let hasher = KeyHasher::default();
    let mut map: KeyMap<(usize, u8)> = KeyMap::default();
    for len in [1usize, 8, 9, 16, 17, 31, 32, 33, 64] {
        let a: Vec<u8> = (0..len as u8).map(|b| b.wrapping_mul(37) | 1).collect();
        let mut b = a.clone();
        b[len - 1] ^= 0x80;
        let ka = StateKey::new(ns(3), 5, &a).unwrap();
        let kb = StateKey::new(ns(3), 5, &b).unwrap();
        assert_ne!(
            hasher.hash_one(ka),
            hasher.hash_one(kb),
            "{len}-byte hashes differing in their last byte hash alike"
        );
        assert_eq!(map.insert(ka, (len, 0)), None);
        assert_eq!(map.insert(kb, (len, 1)), None);
    }
    for len in [1usize, 8, 9, 16, 17, 31, 32, 33, 64] {
        let a: Vec<u8> = (0..len as u8).map(|b| b.wrapping_mul(37) | 1).collect();
        let native = NativeHash::new(&a).unwrap();
        let parts = KeyRef {
            namespace: &ns(3),
            group: 5,
            native: &native,
        };
        assert_eq!(map.get(&parts), Some(&(len, 0)));
        assert_eq!(
            hasher.hash_one(parts),
            hasher.hash_one(StateKey::new(ns(3), 5, &a).unwrap())
        );
    }
}

/// `KeyMap` hashes only part of the namespace and the used native bytes;
/// equality must still tell apart every field, so keys that differ only past
/// the hashed namespace prefix, only in length, or only in group are all
/// distinct entries, and a decoded key finds its original.
#[test]
fn key_map_distinguishes_every_field() {
    use orbitkv_components::{KeyMap, KeyRef};
    let mut late = [7u8; 32];
    late[31] = 8; // differs only past the 8 hashed namespace bytes
    let keys = [
        StateKey::new(ns(7), 0, &[1, 2, 3]).unwrap(),
        StateKey::new(Namespace(late), 0, &[1, 2, 3]).unwrap(),
        StateKey::new(ns(7), 1, &[1, 2, 3]).unwrap(),
        StateKey::new(ns(7), 0, &[1, 2, 3, 0]).unwrap(), // same prefix, longer
        StateKey::new(ns(7), 0, &[1, 2]).unwrap(),
    ];
    let mut map: KeyMap<usize> = KeyMap::default();
    for (i, k) in keys.iter().enumerate() {
        assert_eq!(
            map.insert(*k, i),
            None,
            "{k:?} collided with an earlier key"
        );
    }
    for (i, k) in keys.iter().enumerate() {
        let decoded = StateKey::decode(&k.encode()).unwrap();
        assert_eq!(map.get(&decoded), Some(&i));
        // Borrowed parts find the same entry (they hash the same).
        let parts = KeyRef {
            namespace: &decoded.namespace,
            group: decoded.group,
            native: &decoded.native,
        };
        assert_eq!(map.get(&parts), Some(&i));
    }
    assert_ne!(keys[3].native, keys[0].native);
    // Parts of no stored key find nothing, whichever field differs.
    let native = NativeHash::new(&[1, 2, 3]).unwrap();
    let longer = NativeHash::new(&[1, 2, 3, 0, 0]).unwrap();
    let mut other = [7u8; 32];
    other[31] = 9;
    for (namespace, group, native) in [
        (Namespace(other), 0, native),
        (ns(7), 2, native),
        (ns(7), 0, longer),
    ] {
        let parts = KeyRef {
            namespace: &namespace,
            group,
            native: &native,
        };
        assert!(!map.contains_key(&parts), "{parts:?}");
    }
}
