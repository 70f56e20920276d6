//! `orbitkv demo`: identity, sealing and hybrid boundary selection on an
//! embedded example, printed step by step.

use std::path::Path;

use anyhow::Result;
use orbitkv_components::api::Rank;
use orbitkv_components::value::{CanonicalMap, CanonicalValue};
use orbitkv_components::{
    ContractSpec, GroupEvidence, GroupSpec, IdentityInputs, RecoveryContract, StateBundle,
    StateKey, StorageLayout, common_boundaries, prompt_limit, seal, select_boundary,
    vllm_window_past_tokens,
};

const PAGE: u64 = 64;

fn write_model(dir: &Path) -> Result<()> {
    std::fs::write(
        dir.join("config.json"),
        br#"{"model_type":"tiny_hybrid","hidden_size":64,"sliding_window":101}"#,
    )?;
    std::fs::write(dir.join("model.safetensors"), vec![0x5a; 1 << 20])?;
    std::fs::write(dir.join("tokenizer.json"), br#"{"model":{"type":"BPE"}}"#)?;
    Ok(())
}

fn inputs(dir: &Path, engine: &str, release: &str) -> IdentityInputs {
    IdentityInputs {
        engine: engine.into(),
        engine_release: release.into(),
        model_dir: dir.into(),
        settings: CanonicalMap::from([("dtype".into(), CanonicalValue::String("bfloat16".into()))]),
        representation: CanonicalMap::from([("page_tokens".into(), CanonicalValue::UInt(PAGE))]),
        ..Default::default()
    }
}

/// One rank's layout: one 16 KiB slot per group.
fn layout(tp_rank: u32, groups: &[GroupSpec]) -> StorageLayout {
    StorageLayout::uniform(&[Rank { tp: tp_rank, pp: 0 }], groups, PAGE, 16384)
}

fn ends(from: u64, to: u64) -> Vec<u64> {
    (from / PAGE..=to / PAGE).map(|p| p * PAGE).collect()
}

pub fn run() -> Result<()> {
    println!("OrbitKV demo: identity, sealing and hybrid recovery on an embedded example\n");
    let a = tempfile::tempdir()?;
    let b = tempfile::tempdir()?;
    write_model(a.path())?;
    write_model(b.path())?;

    println!("1. Computation identity (content of weights, tokenizer, config; engine; settings)");
    let vllm = inputs(a.path(), "vllm", "0.33.0").resolve(&|_| {})?;
    let moved = inputs(b.path(), "vllm", "0.33.0").resolve(&|_| {})?;
    let sglang = inputs(a.path(), "sglang", "0.5.23").resolve(&|_| {})?;
    let short = |d: &[u8; 32]| hex::encode(&d[..8]);
    println!("   vllm 0.33.0 identity    {}", short(&vllm.digest));
    println!(
        "   same files, other dir   {}  (relocation keeps identity: {})",
        short(&moved.digest),
        vllm.digest == moved.digest
    );
    println!(
        "   sglang 0.5.23 identity  {}  (engines never share: {})",
        short(&sglang.digest),
        vllm.digest != sglang.digest
    );

    let window = vllm_window_past_tokens(101)?;
    let groups = |window| {
        vec![
            GroupSpec::attention(0),
            GroupSpec::sliding_window(1, window),
            GroupSpec::recurrent(2),
        ]
    };
    println!(
        "\n2. Sealing: identity + storage layout + group shapes = namespace (one per TP rank)"
    );
    let (shape, wider) = (groups(window), groups(window + PAGE));
    let ns0 = seal(&vllm.digest, &layout(0, &shape), &shape)?;
    let ns1 = seal(&vllm.digest, &layout(1, &shape), &shape)?;
    let other_window = seal(&vllm.digest, &layout(0, &wider), &wider)?;
    println!("   rank 0 namespace {}", &ns0.to_hex()[..16]);
    println!("   rank 1 namespace {}", &ns1.to_hex()[..16]);
    println!(
        "   rank 0, window {} instead of {window}: {}  (shapes never share: {})",
        window + PAGE,
        &other_window.to_hex()[..16],
        other_window != ns0
    );

    println!("\n3. Contract: {PAGE}-token pages; group 0 full attention (prefix), group 1 sliding");
    println!("   window (vLLM window 101 = {window} past tokens), group 2 recurrent checkpoint");
    let spec = |namespace| ContractSpec {
        namespace,
        page_tokens: PAGE,
        groups: groups(window),
    };
    let c0 = RecoveryContract::compile(&spec(ns0))?;
    let c1 = RecoveryContract::compile(&spec(ns1))?;
    let ranges = c0.required_ranges(ns0, 128, 512)?;
    let shown: Vec<String> = ranges
        .iter()
        .map(|r| format!("({},{},{})", r.group, r.start, r.end))
        .collect();
    println!(
        "   required_ranges(origin 128, boundary 512) = [{}]",
        shown.join(", ")
    );
    match c0.required_ranges(ns1, 128, 512) {
        Err(e) => println!("   asked under rank 1's namespace: refused ({e})"),
        Ok(_) => anyhow::bail!("a foreign namespace was accepted"),
    }

    println!(
        "\n4. Evidence from a query at origin 128 over [128, 576): checkpoints differ by rank"
    );
    let bundle = |namespace, checkpoints: Vec<u64>| StateBundle {
        namespace,
        start: 128,
        end: 576,
        groups: vec![
            GroupEvidence {
                group: 0,
                page_ends: ends(192, 576),
            },
            GroupEvidence {
                group: 1,
                page_ends: ends(192, 576),
            },
            GroupEvidence {
                group: 2,
                page_ends: checkpoints,
            },
        ],
    };
    let r0 = c0.restorable_boundaries(&bundle(ns0, vec![256, 448, 512]))?;
    let r1 = c1.restorable_boundaries(&bundle(ns1, vec![256, 384]))?;
    let common = common_boundaries(&[r0.clone(), r1.clone()]);
    println!("   rank 0 legal boundaries {r0:?}");
    println!("   rank 1 legal boundaries {r1:?}");
    println!("   common (intersection)   {common:?}");
    let min_of_max = r0.last().copied().min(r1.last().copied());
    println!(
        "   min of maxima would pick {min_of_max:?}: rank 0 holds no checkpoint there, a false hit"
    );
    let prompt_len = 600;
    let selected = select_boundary(&common, prompt_limit(prompt_len));
    println!(
        "   prompt_len {prompt_len} -> limit {} -> selected {selected:?}",
        prompt_limit(prompt_len)
    );

    println!("\n5. Load validation at the selected boundary (group 0 keys)");
    let Some(b) = selected else {
        anyhow::bail!("no boundary selected")
    };
    let range = c0.required_ranges(ns0, 128, b)?[0];
    let keys: Vec<StateKey> = (range.start / PAGE..range.end / PAGE)
        .map(|p| StateKey::new(ns0, 0, &p.to_le_bytes()))
        .collect::<Result<_, _>>()?;
    c0.validate_load(&range, &keys, &keys, &[])?;
    println!(
        "   transfer all {} keys of [{}, {}): exact cover, accepted",
        keys.len(),
        range.start,
        range.end
    );
    match c0.validate_load(&range, &keys, &keys, &keys[..1]) {
        Err(e) => println!("   transfer + retain the same key: refused ({e})"),
        Ok(()) => anyhow::bail!("an overlapping load was accepted"),
    }
    println!("\nEvery doubtful candidate above became a miss; the engine recomputes those tokens.");
    Ok(())
}
