//! The command-line surfaces users debug deployments with: JSON in, JSON out,
//! exit 2 with one line on bad input.

use std::fs;
use std::path::Path;
use std::process::{Command, Output};

use serde_json::{Value, json};

const NS: &str = "5555555555555555555555555555555555555555555555555555555555555555";

fn orbitkv(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_orbitkv"));
    cmd.args(args)
        .env_remove("ORBITKV_MODEL_FINGERPRINT")
        .env_remove("ORBITKV_CACHE_SCOPE");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("run orbitkv")
}

fn ok_json(out: Output) -> Value {
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("stdout is JSON")
}

/// Exit status 2 and exactly one line on stderr that contains `needle`.
fn assert_bad_input(out: Output, needle: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "stderr: {stderr}");
    assert_eq!(
        stderr.trim_end().lines().count(),
        1,
        "not one line: {stderr:?}"
    );
    assert!(stderr.contains(needle), "{needle:?} not in {stderr:?}");
    assert!(out.stdout.is_empty());
}

fn write_json(dir: &Path, name: &str, v: &Value) -> String {
    let p = dir.join(name);
    fs::write(&p, serde_json::to_vec(v).unwrap()).unwrap();
    p.to_str().unwrap().to_owned()
}

fn model(dir: &Path) {
    fs::write(dir.join("config.json"), br#"{"model_type":"llama"}"#).unwrap();
    fs::write(dir.join("model.safetensors"), vec![1u8; 300_000]).unwrap();
    fs::write(dir.join("tokenizer.json"), b"{}").unwrap();
}

fn settings() -> Value {
    json!({
        "engine": "vllm", "engine_version": "0.33.0",
        "settings": {"dtype": "bfloat16", "tensor_parallel_size": 1},
        "representation": {"block_size": 16, "kv_layout": "NHD"},
        "layout": {"slots": [{"layer": 0, "group": 0, "tp_rank": 0, "pp_rank": 0,
            "segment_bytes": 4096, "padded_page_bytes": 4096, "page_tokens": 16,
            "dtype": "bfloat16", "layout": "NHD", "strides": [128, 1], "device_addr": 1234}],
            "pool_capacity_pages": 100},
        "groups": [{"id": 0, "rule": "prefix", "components": ["attention_kv"]}]
    })
}

#[test]
fn identity_reports_inputs_and_throughput() {
    let a = tempfile::tempdir().unwrap();
    let b = tempfile::tempdir().unwrap();
    model(a.path());
    model(b.path());
    let cfg = tempfile::tempdir().unwrap();
    let s = write_json(cfg.path(), "s.json", &settings());
    let run = |dir: &Path| {
        ok_json(orbitkv(
            &[
                "identity",
                "--model-dir",
                dir.to_str().unwrap(),
                "--settings",
                &s,
            ],
            &[],
        ))
    };
    let ra = run(a.path());
    let rb = run(b.path());
    assert_eq!(ra["namespace"], rb["namespace"]);
    assert_eq!(ra["identity"].as_str().unwrap().len(), 64);
    assert_eq!(ra["bytes_hashed"], 300_000 + 22 + 2);
    assert_eq!(ra["files_hashed"], 3);
    assert!(ra["seconds"].as_f64().unwrap() >= 0.0);
    let names: Vec<&str> = ra["inputs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "engine",
            "engine_release",
            "model_artifacts",
            "configuration",
            "config_overrides",
            "settings",
            "representation",
            "cache_scope"
        ]
    );
    assert_eq!(ra["inputs"][2]["source"], "directory");

    // Device addresses and capacity do not move the namespace; a dtype does.
    let mut moved = settings();
    moved["layout"]["slots"][0]["device_addr"] = json!(999_999);
    moved["layout"]["pool_capacity_pages"] = json!(1);
    let s2 = write_json(cfg.path(), "s2.json", &moved);
    let r = ok_json(orbitkv(
        &[
            "identity",
            "--model-dir",
            a.path().to_str().unwrap(),
            "--settings",
            &s2,
        ],
        &[],
    ));
    assert_eq!(r["namespace"], ra["namespace"]);

    // A group's shape is sealed: the same slots read as another rule are
    // another namespace.
    let mut reshaped = settings();
    reshaped["groups"][0]["rule"] = json!({"window": 64});
    reshaped["groups"][0]["components"] = json!(["sliding_window_kv"]);
    let s3 = write_json(cfg.path(), "s3.json", &reshaped);
    let r = ok_json(orbitkv(
        &[
            "identity",
            "--model-dir",
            a.path().to_str().unwrap(),
            "--settings",
            &s3,
        ],
        &[],
    ));
    assert_ne!(r["namespace"], ra["namespace"]);
    assert_eq!(r["identity"], ra["identity"]);

    // The engine flag overrides the file and changes everything.
    let r = ok_json(orbitkv(
        &[
            "identity",
            "--model-dir",
            a.path().to_str().unwrap(),
            "--settings",
            &s,
            "--engine",
            "sglang",
            "--engine-version",
            "0.5.23",
        ],
        &[],
    ));
    assert_ne!(r["namespace"], ra["namespace"]);

    // An operator digest skips artifact reads.
    let fp = "ab".repeat(32);
    let r = ok_json(orbitkv(
        &[
            "identity",
            "--model-dir",
            a.path().to_str().unwrap(),
            "--settings",
            &s,
        ],
        &[("ORBITKV_MODEL_FINGERPRINT", &fp)],
    ));
    assert_eq!(r["bytes_hashed"], 0);
    assert_eq!(r["inputs"][2]["source"], "operator_fingerprint");
    assert_eq!(r["inputs"][2]["value"], fp.as_str());

    // A scope separates tenants.
    let r = ok_json(orbitkv(
        &[
            "identity",
            "--model-dir",
            a.path().to_str().unwrap(),
            "--settings",
            &s,
        ],
        &[("ORBITKV_CACHE_SCOPE", "tenant-a")],
    ));
    assert_ne!(r["namespace"], ra["namespace"]);
    assert_eq!(r["inputs"][7]["value"], "tenant-a");
}

#[test]
fn identity_bad_inputs_exit_2() {
    let a = tempfile::tempdir().unwrap();
    model(a.path());
    let dir = a.path().to_str().unwrap();
    let cfg = tempfile::tempdir().unwrap();
    let s = write_json(cfg.path(), "s.json", &settings());
    assert_bad_input(
        orbitkv(
            &[
                "identity",
                "--model-dir",
                dir,
                "--settings",
                &s,
                "--hub-revision",
                "main",
            ],
            &[],
        ),
        "not a full 40-hex commit",
    );
    assert_bad_input(
        orbitkv(
            &["identity", "--model-dir", dir, "--settings", &s],
            &[("ORBITKV_MODEL_FINGERPRINT", "ABC")],
        ),
        "ORBITKV_MODEL_FINGERPRINT must be exactly 64 lowercase hex digits",
    );
    let mut lora = settings();
    lora["active_adapters"] = json!(["my-lora"]);
    let l = write_json(cfg.path(), "l.json", &lora);
    assert_bad_input(
        orbitkv(&["identity", "--model-dir", dir, "--settings", &l], &[]),
        "active adapters are not supported",
    );
    let mut undeclared = settings();
    undeclared["layout"]["slots"][0]["group"] = json!(3);
    let g = write_json(cfg.path(), "g.json", &undeclared);
    assert_bad_input(
        orbitkv(&["identity", "--model-dir", dir, "--settings", &g], &[]),
        "names group 3, which is not declared",
    );
    let mut unknown = settings();
    unknown["extra"] = json!(1);
    let u = write_json(cfg.path(), "u.json", &unknown);
    assert_bad_input(
        orbitkv(&["identity", "--model-dir", dir, "--settings", &u], &[]),
        "unknown field `extra`",
    );
    let mut null = settings();
    null["settings"]["dtype"] = Value::Null;
    let n = write_json(cfg.path(), "n.json", &null);
    assert_bad_input(
        orbitkv(&["identity", "--model-dir", dir, "--settings", &n], &[]),
        "`dtype` is null",
    );
    let mut no_layout = settings();
    no_layout["layout"]["slots"] = json!([]);
    let nl = write_json(cfg.path(), "nl.json", &no_layout);
    assert_bad_input(
        orbitkv(&["identity", "--model-dir", dir, "--settings", &nl], &[]),
        "no slots",
    );
    let missing = a.path().join("missing");
    assert_bad_input(
        orbitkv(
            &[
                "identity",
                "--model-dir",
                missing.to_str().unwrap(),
                "--settings",
                &s,
            ],
            &[],
        ),
        "No such file",
    );
}

fn contract() -> Value {
    json!({"namespace": NS, "page_tokens": 64, "groups": [
        {"id": 0, "rule": "prefix", "components": ["attention_kv"]},
        {"id": 1, "rule": {"window": 100}, "components": ["sliding_window_kv"]},
        {"id": 2, "rule": "checkpoint", "components": ["recurrent_checkpoint", "convolution_state"]}]})
}

fn bundle(checkpoints: &[u64]) -> Value {
    let all: Vec<u64> = (3..=8).map(|p| p * 64).collect();
    json!({"namespace": NS, "start": 128, "end": 512, "groups": [
        {"group": 0, "page_ends": all}, {"group": 1, "page_ends": all},
        {"group": 2, "page_ends": checkpoints}]})
}

fn stdout(out: Output) -> String {
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn contract_commands_print_exact_json() {
    let d = tempfile::tempdir().unwrap();
    let c = write_json(d.path(), "c.json", &contract());
    assert_eq!(
        stdout(orbitkv(
            &[
                "contract",
                "ranges",
                "--contract",
                &c,
                "--start",
                "128",
                "--end",
                "512"
            ],
            &[]
        )),
        "[{\"group\":0,\"start\":128,\"end\":512},{\"group\":1,\"start\":384,\"end\":512},{\"group\":2,\"start\":448,\"end\":512}]\n"
    );
    assert_eq!(
        stdout(orbitkv(
            &[
                "contract",
                "ranges",
                "--contract",
                &c,
                "--start",
                "128",
                "--end",
                "192"
            ],
            &[]
        )),
        "[{\"group\":0,\"start\":128,\"end\":192},{\"group\":1,\"start\":128,\"end\":192},{\"group\":2,\"start\":128,\"end\":192}]\n"
    );
    let r0 = write_json(d.path(), "r0.json", &bundle(&[256, 448, 512]));
    let r1 = write_json(d.path(), "r1.json", &bundle(&[256, 384]));
    assert_eq!(
        stdout(orbitkv(
            &["contract", "boundaries", "--contract", &c, "--bundle", &r0],
            &[]
        )),
        "[256,448,512]\n"
    );
    assert_eq!(
        stdout(orbitkv(
            &["contract", "boundaries", "--contract", &c, "--bundle", &r1],
            &[]
        )),
        "[256,384]\n"
    );
    assert_eq!(
        stdout(orbitkv(
            &[
                "contract",
                "common",
                "--contract",
                &c,
                "--bundle",
                &r0,
                "--bundle",
                &r1
            ],
            &[]
        )),
        "[256]\n"
    );
    let select = |prompt: &str, bundles: &[&str]| {
        let mut args = vec![
            "contract",
            "select",
            "--contract",
            &c,
            "--prompt-len",
            prompt,
        ];
        for b in bundles {
            args.extend(["--bundle", b]);
        }
        stdout(orbitkv(&args, &[]))
    };
    assert_eq!(select("600", &[&r0, &r1]), "256\n");
    // The final prompt token is always computed: prompt 512 may end at 511.
    assert_eq!(select("512", &[&r0]), "448\n");
    assert_eq!(select("513", &[&r0]), "512\n");
    assert_eq!(select("256", &[&r0]), "null\n");
}

#[test]
fn contract_bad_inputs_exit_2() {
    let d = tempfile::tempdir().unwrap();
    let c = write_json(d.path(), "c.json", &contract());
    assert_bad_input(
        orbitkv(
            &[
                "contract",
                "ranges",
                "--contract",
                &c,
                "--start",
                "100",
                "--end",
                "512",
            ],
            &[],
        ),
        "start 100 is not aligned",
    );
    let mut dsa = contract();
    dsa["groups"][1]["components"] = json!(["dsa"]);
    dsa["groups"][1]["rule"] = json!("prefix");
    let bad = write_json(d.path(), "dsa.json", &dsa);
    assert_bad_input(
        orbitkv(
            &[
                "contract",
                "ranges",
                "--contract",
                &bad,
                "--start",
                "0",
                "--end",
                "64",
            ],
            &[],
        ),
        "unsupported component dsa",
    );
    let mut empty = contract();
    empty["namespace"] = json!("");
    let bad = write_json(d.path(), "empty.json", &empty);
    assert_bad_input(
        orbitkv(
            &[
                "contract",
                "ranges",
                "--contract",
                &bad,
                "--start",
                "0",
                "--end",
                "64",
            ],
            &[],
        ),
        "namespace is empty",
    );
    let mut gap = bundle(&[256]);
    gap["groups"][0]["page_ends"] = json!([256, 192]);
    let g = write_json(d.path(), "gap.json", &gap);
    assert_bad_input(
        orbitkv(
            &["contract", "boundaries", "--contract", &c, "--bundle", &g],
            &[],
        ),
        "ends must strictly increase",
    );
    let mut other = bundle(&[256]);
    other["namespace"] = json!("66".repeat(32));
    let o = write_json(d.path(), "other.json", &other);
    assert_bad_input(
        orbitkv(
            &[
                "contract",
                "select",
                "--contract",
                &c,
                "--bundle",
                &o,
                "--prompt-len",
                "600",
            ],
            &[],
        ),
        "namespace mismatch",
    );
    fs::write(d.path().join("broken.json"), b"{\"namespace\": ").unwrap();
    let broken = d.path().join("broken.json");
    assert_bad_input(
        orbitkv(
            &[
                "contract",
                "boundaries",
                "--contract",
                &c,
                "--bundle",
                broken.to_str().unwrap(),
            ],
            &[],
        ),
        "broken.json",
    );
    assert_bad_input(
        orbitkv(
            &[
                "contract",
                "ranges",
                "--contract",
                "/nonexistent.json",
                "--start",
                "0",
                "--end",
                "0",
            ],
            &[],
        ),
        "/nonexistent.json",
    );
    // clap's own usage errors also exit 2.
    assert_eq!(
        orbitkv(&["contract", "ranges", "--start", "x"], &[])
            .status
            .code(),
        Some(2)
    );
}

#[test]
fn demo_runs() {
    let out = stdout(orbitkv(&["demo"], &[]));
    assert!(out.contains(
        "required_ranges(origin 128, boundary 512) = [(0,128,512), (1,384,512), (2,448,512)]"
    ));
    assert!(out.contains("common (intersection)   [256]"));
}

#[test]
fn replay_runs_the_embedded_default_and_reports() {
    let out = stdout(orbitkv(&["replay"], &[]));
    assert!(out.contains("OrbitKV replay: multi_turn_chat"), "{out}");
    assert!(out.contains("invariant violations: 0"), "{out}");
    assert!(out.contains("byte mismatches (false hits): 0"), "{out}");
    let d = tempfile::tempdir().unwrap();
    let svg = d.path().join("plot.svg");
    let json = ok_json(orbitkv(
        &["replay", "--json", "--plot", svg.to_str().unwrap()],
        &[],
    ));
    assert_eq!(json["report_version"], 1);
    assert_eq!(json["totals"]["hits"], 5);
    let svg = fs::read_to_string(svg).unwrap();
    assert!(
        svg.starts_with("<svg") && svg.contains("hit rate"),
        "not an SVG plot"
    );
    // Same trace, same flags: the same bytes.
    assert_eq!(
        stdout(orbitkv(&["replay", "--json"], &[])),
        stdout(orbitkv(&["replay", "--json"], &[]))
    );
}

#[test]
fn replay_reports_bad_trace_lines_and_exits_2() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("bad.jsonl");
    fs::write(
        &p,
        "{\"orbitkv_trace\":1}\n{\"t\":0,\"tick\":{}}\n{\"t\":1,\"nonsense\":3}\n",
    )
    .unwrap();
    assert_bad_input(orbitkv(&["replay", p.to_str().unwrap()], &[]), "line 3:");
}

#[test]
fn fuzz_runs_seeds_clean() {
    let d = tempfile::tempdir().unwrap();
    let out = orbitkv(
        &[
            "fuzz",
            "--seed",
            "7",
            "--seeds",
            "2",
            "--ticks",
            "300",
            "--out",
            d.path().to_str().unwrap(),
        ],
        &[],
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("2 clean, 0 failed"), "{text}");
}
