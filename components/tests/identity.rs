//! Computation identity and sealing: what changes the namespace, what must
//! not, and every way an input fails closed.

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use orbitkv_components::artifacts::{CHUNK_BYTES, fingerprint_dir};
use orbitkv_components::contract::{ComponentKind, GroupSpec, Rule};
use orbitkv_components::identity::{ArtifactIdentity, IdentityError};
use orbitkv_components::value::{CanonicalMap, CanonicalValue};
use orbitkv_components::{
    IdentityInputs, LayoutError, ResolvedIdentity, StorageLayout, StorageSlot, seal,
};

type Mutation<T> = Box<dyn Fn(&mut T)>;

fn write(dir: &Path, rel: &str, bytes: &[u8]) {
    let p = dir.join(rel);
    fs::create_dir_all(p.parent().unwrap()).unwrap();
    fs::write(p, bytes).unwrap();
}

/// A tiny but complete model directory.
fn model_dir() -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    write(
        d.path(),
        "config.json",
        br#"{"model_type":"llama","hidden_size":64,"rope_scaling":null}"#,
    );
    write(d.path(), "model.safetensors", &[7u8; 10_000]);
    write(d.path(), "tokenizer.json", br#"{"version":"1.0"}"#);
    write(d.path(), "tokenizer.model", b"spm");
    write(d.path(), "chat_template.jinja", b"{{ messages }}");
    write(d.path(), "modeling_tiny.py", b"class Tiny: pass\n");
    write(d.path(), "README.md", b"not part of the computation");
    d
}

fn s(v: &str) -> CanonicalValue {
    CanonicalValue::String(v.into())
}

fn inputs(dir: &Path) -> IdentityInputs {
    IdentityInputs {
        engine: "vllm".into(),
        engine_release: "0.33.0".into(),
        model_dir: dir.to_path_buf(),
        settings: CanonicalMap::from([("dtype".to_string(), s("bfloat16"))]),
        representation: CanonicalMap::from([("block_size".to_string(), CanonicalValue::UInt(16))]),
        ..Default::default()
    }
}

fn resolve(i: &IdentityInputs) -> Result<ResolvedIdentity, IdentityError> {
    i.resolve(&|_| {})
}

fn digest(i: &IdentityInputs) -> [u8; 32] {
    resolve(i).unwrap().digest
}

#[test]
fn relocated_copy_keeps_its_identity() {
    let a = model_dir();
    let b = model_dir();
    assert_eq!(digest(&inputs(a.path())), digest(&inputs(b.path())));
}

#[test]
fn equal_sized_replacement_with_same_mtime_changes_identity() {
    let d = model_dir();
    let before = digest(&inputs(d.path()));
    let path = d.path().join("model.safetensors");
    let mtime = fs::metadata(&path).unwrap().modified().unwrap();
    fs::write(&path, [8u8; 10_000]).unwrap();
    fs::File::options()
        .write(true)
        .open(&path)
        .unwrap()
        .set_modified(mtime)
        .unwrap();
    assert_eq!(fs::metadata(&path).unwrap().modified().unwrap(), mtime);
    assert_eq!(fs::metadata(&path).unwrap().len(), 10_000);
    assert_ne!(before, digest(&inputs(d.path())));
}

#[test]
fn every_artifact_class_participates() {
    for rel in [
        "model.safetensors",
        "tokenizer.json",
        "tokenizer.model",
        "chat_template.jinja",
        "modeling_tiny.py",
        "config.json",
    ] {
        let d = model_dir();
        let before = digest(&inputs(d.path()));
        let mut bytes = fs::read(d.path().join(rel)).unwrap();
        // Keep JSON valid: append whitespace there, flip a byte elsewhere.
        if rel.ends_with(".json") {
            bytes.push(b' ');
        } else {
            bytes[0] ^= 1;
        }
        fs::write(d.path().join(rel), bytes).unwrap();
        assert_ne!(
            before,
            digest(&inputs(d.path())),
            "{rel} did not participate"
        );
    }
}

#[test]
fn non_artifacts_and_hidden_folders_do_not_participate() {
    let d = model_dir();
    let before = digest(&inputs(d.path()));
    write(d.path(), "README.md", b"edited");
    write(d.path(), "LICENSE", b"new");
    write(
        d.path(),
        ".cache/huggingface/download/model.safetensors.metadata",
        b"etag 123",
    );
    write(d.path(), ".git/objects/ab/cd.json", b"{}");
    assert_eq!(before, digest(&inputs(d.path())));
}

#[test]
fn relative_paths_participate() {
    let a = model_dir();
    let b = model_dir();
    fs::rename(
        b.path().join("modeling_tiny.py"),
        b.path().join("modeling_other.py"),
    )
    .unwrap();
    assert_ne!(digest(&inputs(a.path())), digest(&inputs(b.path())));
    // A nested shard counts under its relative path.
    write(a.path(), "original/consolidated.pth", b"w");
    let fp = fingerprint_dir(a.path(), &|_| {}).unwrap();
    assert!(
        fp.files
            .iter()
            .any(|f| f.path == "original/consolidated.pth")
    );
}

#[test]
fn large_files_are_chunked_and_every_chunk_counts() {
    let d = model_dir();
    let big = vec![3u8; CHUNK_BYTES as usize + 4096];
    write(d.path(), "big.safetensors", &big);
    let seen = AtomicU64::new(0);
    let fp = fingerprint_dir(d.path(), &|n| {
        seen.fetch_add(n, Ordering::Relaxed);
    })
    .unwrap();
    assert_eq!(seen.load(Ordering::Relaxed), fp.bytes_hashed);
    assert_eq!(
        fp.bytes_hashed,
        fp.files.iter().map(|f| f.bytes).sum::<u64>()
    );
    let mut changed = big.clone();
    *changed.last_mut().unwrap() = 4; // in the second chunk
    write(d.path(), "big.safetensors", &changed);
    assert_ne!(
        fingerprint_dir(d.path(), &|_| {}).unwrap().digest,
        fp.digest
    );
}

#[test]
fn engines_never_share_an_identity() {
    let d = model_dir();
    let mut other = inputs(d.path());
    other.engine = "sglang".into();
    assert_ne!(digest(&inputs(d.path())), digest(&other));
    let mut release = inputs(d.path());
    release.engine_release = "0.33.1".into();
    assert_ne!(digest(&inputs(d.path())), digest(&release));
}

#[test]
fn settings_representation_overrides_and_scope_participate() {
    let d = model_dir();
    let base = digest(&inputs(d.path()));
    let mut i = inputs(d.path());
    i.settings.insert("dtype".into(), s("float16"));
    assert_ne!(base, digest(&i));
    let mut i = inputs(d.path());
    i.representation
        .insert("block_size".into(), CanonicalValue::UInt(32));
    assert_ne!(base, digest(&i));
    let mut i = inputs(d.path());
    i.config_overrides
        .insert("max_position_embeddings".into(), CanonicalValue::UInt(4096));
    assert_ne!(base, digest(&i));
    let mut i = inputs(d.path());
    i.cache_scope = Some("tenant-a".into());
    let a = digest(&i);
    i.cache_scope = Some("tenant-b".into());
    assert_ne!(a, digest(&i));
    assert_ne!(a, base);
}

#[test]
fn operator_fingerprint_skips_artifacts_but_not_configuration() {
    let d = tempfile::tempdir().unwrap();
    // No weights at all: only the configuration is read.
    write(d.path(), "config.json", br#"{"model_type":"llama"}"#);
    let mut i = inputs(d.path());
    i.operator_fingerprint = Some("ab".repeat(32));
    let r = resolve(&i).unwrap();
    assert!(r.fingerprint.is_none());
    assert!(matches!(r.parts.artifacts, ArtifactIdentity::Operator(_)));
    write(d.path(), "config.json", br#"{"model_type":"mistral"}"#);
    assert_ne!(
        r.digest,
        digest(&i),
        "configuration must participate with an operator digest"
    );
    // Different operator digests differ.
    let before = digest(&i);
    i.operator_fingerprint = Some("cd".repeat(32));
    assert_ne!(before, digest(&i));
}

#[test]
fn bad_operator_fingerprints_are_errors() {
    let d = model_dir();
    for bad in [
        "",
        "AB".repeat(32).as_str(),
        &"ab".repeat(31),
        &"ab".repeat(33),
        &"zz".repeat(32),
        &format!(" {}", "a".repeat(63)),
    ] {
        let mut i = inputs(d.path());
        i.operator_fingerprint = Some(bad.to_string());
        assert!(
            matches!(resolve(&i), Err(IdentityError::BadFingerprint(v)) if v == bad),
            "{bad:?} accepted"
        );
    }
}

#[test]
fn hub_revisions_must_be_full_commits() {
    let d = model_dir();
    let mut i = inputs(d.path());
    let full = "0123456789abcdef0123456789abcdef01234567";
    i.hub_revision = Some(full.into());
    let r = resolve(&i).unwrap();
    assert_eq!(
        r.parts.artifacts,
        ArtifactIdentity::HubRevision(full.into())
    );
    assert!(r.fingerprint.is_none());
    i.hub_revision = Some(full.to_uppercase());
    assert_eq!(
        digest(&i),
        r.digest,
        "hex case does not name a different commit"
    );
    for bad in [
        "main",
        "v1.0",
        "0123456",
        &full[..39],
        &format!("{full}0"),
        "refs/pr/1",
        &"g".repeat(40),
    ] {
        i.hub_revision = Some(bad.into());
        assert!(
            matches!(resolve(&i), Err(IdentityError::BadHubRevision(v)) if v == bad),
            "{bad:?} accepted"
        );
    }
}

#[test]
fn adapters_fail_closed() {
    let d = model_dir();
    let mut i = inputs(d.path());
    i.active_adapters = vec!["sql-lora".into()];
    assert!(matches!(resolve(&i), Err(IdentityError::AdaptersActive(m)) if m.contains("sql-lora")));
    write(d.path(), "adapter_config.json", br#"{"peft_type":"LORA"}"#);
    assert!(matches!(
        resolve(&inputs(d.path())),
        Err(IdentityError::AdaptersActive(_))
    ));
}

#[test]
fn unestablished_inputs_fail_closed() {
    let d = model_dir();
    let cases: Vec<(&str, Mutation<IdentityInputs>)> = vec![
        ("engine", Box::new(|i| i.engine = String::new())),
        ("engine", Box::new(|i| i.engine = "vLLM".into())),
        (
            "engine_release",
            Box::new(|i| i.engine_release = String::new()),
        ),
        (
            "engine_release",
            Box::new(|i| i.engine_release = "0.33 rc".into()),
        ),
        ("settings", Box::new(|i| i.settings.clear())),
        (
            "settings",
            Box::new(|i| {
                i.settings.insert("kv_dtype".into(), CanonicalValue::Null);
            }),
        ),
        ("representation", Box::new(|i| i.representation.clear())),
        (
            "representation",
            Box::new(|i| {
                i.representation.insert(
                    "strides".into(),
                    CanonicalValue::Object(BTreeMap::from([("k".into(), CanonicalValue::Null)])),
                );
            }),
        ),
        (
            "cache_scope",
            Box::new(|i| i.cache_scope = Some(String::new())),
        ),
        (
            "cache_scope",
            Box::new(|i| i.cache_scope = Some("a\nb".into())),
        ),
        (
            "cache_scope",
            Box::new(|i| i.cache_scope = Some("x".repeat(257))),
        ),
    ];
    for (field, mutate) in cases {
        let mut i = inputs(d.path());
        mutate(&mut i);
        match resolve(&i) {
            Err(IdentityError::Unestablished { field: f, .. }) => assert_eq!(f, field),
            other => panic!("{field}: expected Unestablished, got {other:?}"),
        }
    }
}

#[test]
fn missing_or_broken_model_directories_are_errors() {
    let missing = tempfile::tempdir().unwrap().path().join("nope");
    assert!(matches!(
        resolve(&inputs(&missing)),
        Err(IdentityError::Io { .. })
    ));

    let d = tempfile::tempdir().unwrap();
    write(d.path(), "model.safetensors", b"w");
    assert!(matches!(
        resolve(&inputs(d.path())),
        Err(IdentityError::NoConfig(_))
    ));

    write(d.path(), "config.json", b"[1,2]");
    assert!(matches!(
        resolve(&inputs(d.path())),
        Err(IdentityError::BadConfig { .. })
    ));
    write(d.path(), "config.json", br#"{"a":1,"a":2}"#);
    match resolve(&inputs(d.path())) {
        Err(IdentityError::BadConfig { reason, .. }) => assert!(reason.contains("duplicate key")),
        other => panic!("{other:?}"),
    }

    let d = tempfile::tempdir().unwrap();
    write(d.path(), "config.json", b"{}");
    write(d.path(), "tokenizer.json", b"{}");
    assert!(matches!(
        resolve(&inputs(d.path())),
        Err(IdentityError::NoWeights(_))
    ));
}

#[test]
fn content_is_read_again_on_every_resolve() {
    let d = model_dir();
    let i = inputs(d.path());
    let first = digest(&i);
    write(d.path(), "modeling_tiny.py", b"class Tiny: x = 1\n");
    assert_ne!(first, digest(&i));
}

fn slot(layer: u32, tp_rank: u32) -> StorageSlot {
    StorageSlot {
        layer,
        group: 0,
        tp_rank,
        pp_rank: 0,
        segment_bytes: 4096,
        padded_page_bytes: 4096,
        page_tokens: 16,
        dtype: "bfloat16".into(),
        layout: "NHD".into(),
        strides: vec![128, 1],
        device_addr: 0x7f00_0000_0000 + layer as u64 * 0x10000,
    }
}

/// Two attention groups (slots may name either).
fn groups() -> Vec<GroupSpec> {
    (0..2)
        .map(|id| GroupSpec {
            id,
            rule: Rule::Prefix,
            components: vec![ComponentKind::AttentionKv],
        })
        .collect()
}

fn layout() -> StorageLayout {
    StorageLayout {
        slots: vec![slot(0, 0), slot(1, 0), slot(0, 1), slot(1, 1)],
        pool_capacity_pages: 1000,
    }
}

#[test]
fn device_addresses_and_capacity_do_not_change_the_namespace() {
    let id = [9u8; 32];
    let base = seal(&id, &layout(), &groups()).unwrap();
    let mut l = layout();
    for s in &mut l.slots {
        s.device_addr += 0x1234_5000;
    }
    l.pool_capacity_pages = 7;
    l.slots.reverse();
    assert_eq!(seal(&id, &l, &groups()).unwrap(), base);
}

#[test]
fn every_sealed_field_changes_the_namespace() {
    let id = [9u8; 32];
    let base = seal(&id, &layout(), &groups()).unwrap();
    assert_ne!(seal(&[8u8; 32], &layout(), &groups()).unwrap(), base);
    let edits: Vec<Mutation<StorageSlot>> = vec![
        Box::new(|s| s.layer = 5),
        Box::new(|s| s.group = 1),
        Box::new(|s| s.tp_rank = 3),
        Box::new(|s| s.pp_rank = 1),
        Box::new(|s| s.segment_bytes = 2048),
        Box::new(|s| s.padded_page_bytes = 8192),
        Box::new(|s| s.page_tokens = 32),
        Box::new(|s| s.dtype = "float16".into()),
        Box::new(|s| s.layout = "HND".into()),
        Box::new(|s| s.strides = vec![1, 128]),
    ];
    for (n, edit) in edits.iter().enumerate() {
        let mut l = layout();
        edit(&mut l.slots[0]);
        assert_ne!(
            seal(&id, &l, &groups()).unwrap(),
            base,
            "edit {n} did not change the namespace"
        );
    }
    // Each rank's own layout seals to its own namespace.
    let l = layout();
    assert_ne!(
        seal(&id, &l.for_rank(0, 0), &groups()).unwrap(),
        seal(&id, &l.for_rank(1, 0), &groups()).unwrap()
    );
}

#[test]
fn bad_layouts_are_typed_errors() {
    let id = [9u8; 32];
    assert_eq!(
        seal(&id, &StorageLayout::default(), &groups()),
        Err(LayoutError::NoSlots)
    );
    let mut l = layout();
    l.slots.push(slot(1, 1));
    assert!(matches!(
        seal(&id, &l, &groups()),
        Err(LayoutError::DuplicateSlot {
            layer: 1,
            tp_rank: 1,
            ..
        })
    ));
    for (edit, reason) in [
        (
            Box::new(|s: &mut StorageSlot| s.page_tokens = 0) as Box<dyn Fn(&mut StorageSlot)>,
            "page_tokens is 0",
        ),
        (
            Box::new(|s: &mut StorageSlot| s.segment_bytes = 0),
            "segment_bytes is 0",
        ),
        (
            Box::new(|s: &mut StorageSlot| s.padded_page_bytes = 1),
            "padded_page_bytes is smaller than segment_bytes",
        ),
        (
            Box::new(|s: &mut StorageSlot| s.dtype.clear()),
            "dtype is empty",
        ),
        (
            Box::new(|s: &mut StorageSlot| s.layout.clear()),
            "layout is empty",
        ),
    ] {
        let mut l = layout();
        edit(&mut l.slots[2]);
        assert!(
            matches!(seal(&id, &l, &groups()), Err(LayoutError::BadSlot { reason: r, .. }) if r == reason),
            "{reason}"
        );
    }
}

#[test]
fn every_group_shape_changes_the_namespace() {
    let id = [9u8; 32];
    let base = seal(&id, &layout(), &groups()).unwrap();
    let edits: Vec<(&str, Mutation<GroupSpec>)> = vec![
        (
            "a window",
            Box::new(|g| g.rule = Rule::Window { past_tokens: 32 }),
        ),
        ("a checkpoint", Box::new(|g| g.rule = Rule::Checkpoint)),
        (
            "other kinds",
            Box::new(|g| g.components = vec![ComponentKind::MlaKv]),
        ),
        (
            "an added kind",
            Box::new(|g| g.components.push(ComponentKind::ConvolutionState)),
        ),
    ];
    let mut seen = vec![base];
    for (what, edit) in &edits {
        let mut g = groups();
        edit(&mut g[1]);
        let ns = seal(&id, &layout(), &g).unwrap();
        assert!(!seen.contains(&ns), "{what} did not change the namespace");
        seen.push(ns);
    }
    // Windows of 32 and 64 past tokens are different representations.
    let window = |past_tokens| {
        let mut g = groups();
        g[1].rule = Rule::Window { past_tokens };
        g[1].components = vec![ComponentKind::SlidingWindowKv];
        seal(&id, &layout(), &g).unwrap()
    };
    assert_ne!(window(32), window(64));
    // An extra declared group (without slots on this rank) counts too.
    let mut more = groups();
    more.push(GroupSpec {
        id: 7,
        rule: Rule::Checkpoint,
        components: vec![ComponentKind::RecurrentCheckpoint],
    });
    assert!(!seen.contains(&seal(&id, &layout(), &more).unwrap()));
}

#[test]
fn group_and_kind_order_do_not_change_the_namespace() {
    let id = [9u8; 32];
    let mut g = groups();
    g[0].components = vec![
        ComponentKind::RecurrentCheckpoint,
        ComponentKind::ConvolutionState,
    ];
    g[0].rule = Rule::Checkpoint;
    let base = seal(&id, &layout(), &g).unwrap();
    g.reverse();
    g[1].components.reverse();
    assert_eq!(seal(&id, &layout(), &g).unwrap(), base);
}

#[test]
fn bad_group_declarations_are_typed_errors() {
    let id = [9u8; 32];
    assert_eq!(seal(&id, &layout(), &[]), Err(LayoutError::NoGroups));
    let mut twice = groups();
    twice[1].id = 0;
    assert_eq!(
        seal(&id, &layout(), &twice),
        Err(LayoutError::DuplicateGroup(0))
    );
    let mut kinds = groups();
    kinds[1].components = vec![ComponentKind::AttentionKv, ComponentKind::AttentionKv];
    assert_eq!(
        seal(&id, &layout(), &kinds),
        Err(LayoutError::DuplicateComponent(1))
    );
    let mut l = layout();
    l.slots[3].group = 5;
    assert_eq!(
        seal(&id, &l, &groups()),
        Err(LayoutError::UndeclaredGroup { layer: 1, group: 5 })
    );
}
