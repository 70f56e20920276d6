"""compute_identity: content identity, precedence, fail-closed paths."""

from __future__ import annotations

import json
import os

import pytest

import orbitkv

SETTINGS = {"dtype": "bfloat16", "tensor_parallel_size": 1, "hash_algo": "sha256"}
REPRESENTATION = {"block_size": 16, "kv_layout": "NHD", "kv_dtype": "auto"}
FINGERPRINT = "0123456789abcdef" * 4
LAYOUT = {
    "slots": [
        {
            "layer": 0,
            "group": 0,
            "tp_rank": 0,
            "pp_rank": 0,
            "segment_bytes": 65536,
            "padded_page_bytes": 65536,
            "page_tokens": 16,
            "dtype": "bfloat16",
            "layout": "NHD",
            "strides": [2048, 128, 1],
            "device_addr": 140000000000,
        }
    ],
    "pool_capacity_pages": 8192,
}
GROUPS = [{"id": 0, "rule": "prefix", "components": ["attention_kv"]}]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    monkeypatch.delenv("ORBITKV_MODEL_FINGERPRINT", raising=False)
    monkeypatch.delenv("ORBITKV_CACHE_SCOPE", raising=False)


def make_model(path, weights: bytes = bytes(range(256)) * 64):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    (path / "tokenizer.json").write_text('{"vocab": {"a": 0}}')
    (path / "model.safetensors").write_bytes(weights)
    return path


def identity(model_dir, **kw):
    args = dict(
        engine="vllm",
        engine_version="0.33.0",
        settings=SETTINGS,
        representation=REPRESENTATION,
    )
    args.update(kw)
    return orbitkv.compute_identity(model_dir, **args)


def test_same_content_in_two_dirs_is_the_same_identity(tmp_path):
    a = identity(make_model(tmp_path / "a"))
    b = identity(str(make_model(tmp_path / "elsewhere" / "b")))
    assert a["identity"] == b["identity"]
    assert len(a["identity"]) == 64 and int(a["identity"], 16) >= 0
    assert a["namespace"] is None
    assert a["bytes_hashed"] > 0
    inputs = {i["name"]: i for i in a["inputs"]}
    assert inputs["model_artifacts"]["source"] == "directory"
    assert inputs["model_artifacts"]["files"] == 3
    assert inputs["engine"]["value"] == "vllm"
    assert sorted(inputs["settings"]["keys"]) == sorted(SETTINGS)


def test_a_changed_byte_changes_the_identity(tmp_path):
    weights = bytearray(bytes(range(256)) * 64)
    a = identity(make_model(tmp_path / "a", bytes(weights)))
    weights[1000] ^= 1
    b = identity(make_model(tmp_path / "b", bytes(weights)))
    assert a["identity"] != b["identity"]


def test_every_declared_input_counts(tmp_path):
    d = make_model(tmp_path / "m")
    base = identity(d)["identity"]
    assert identity(d, engine="sglang")["identity"] != base
    assert identity(d, engine_version="0.34.0")["identity"] != base
    assert identity(d, settings=dict(SETTINGS, tensor_parallel_size=2))["identity"] != base
    # 1 and 1.0 are different values.
    assert identity(d, settings=dict(SETTINGS, tensor_parallel_size=1.0))["identity"] != base
    assert identity(d, representation=dict(REPRESENTATION, block_size=32))["identity"] != base
    assert identity(d, config_overrides={"max_model_len": 4096})["identity"] != base
    # Key order never counts.
    reordered = dict(reversed(list(SETTINGS.items())))
    assert identity(d, settings=reordered)["identity"] == base


def test_layout_seals_a_namespace(tmp_path):
    d = make_model(tmp_path / "m")
    a = identity(d, layout=LAYOUT, groups=GROUPS)
    assert len(a["namespace"]) == 64
    assert a["namespace"] != a["identity"]
    moved = json.loads(json.dumps(LAYOUT))
    moved["slots"][0]["device_addr"] = 1
    moved["pool_capacity_pages"] = 1
    assert identity(d, layout=moved, groups=GROUPS)["namespace"] == a["namespace"]
    other = json.loads(json.dumps(LAYOUT))
    other["slots"][0]["strides"] = [1024, 128, 1]
    assert identity(d, layout=other, groups=GROUPS)["namespace"] != a["namespace"]
    with pytest.raises(orbitkv.IdentityError, match="layout"):
        identity(d, layout={"slots": []}, groups=GROUPS)


def test_group_shapes_are_sealed(tmp_path):
    d = make_model(tmp_path / "m")
    base = identity(d, layout=LAYOUT, groups=GROUPS)["namespace"]
    window = [{"id": 0, "rule": {"window": 31}, "components": ["sliding_window_kv"]}]
    wider = [{"id": 0, "rule": {"window": 63}, "components": ["sliding_window_kv"]}]
    mla = [{"id": 0, "rule": "prefix", "components": ["mla_kv"]}]
    shapes = {identity(d, layout=LAYOUT, groups=g)["namespace"] for g in (window, wider, mla)}
    assert len(shapes) == 3 and base not in shapes
    with pytest.raises(orbitkv.IdentityError, match="pass groups"):
        identity(d, layout=LAYOUT)
    with pytest.raises(orbitkv.IdentityError, match="pass layout"):
        identity(d, groups=GROUPS)
    with pytest.raises(orbitkv.IdentityError, match="not declared"):
        identity(d, layout=LAYOUT, groups=[dict(GROUPS[0], id=1)])


def test_operator_fingerprint_and_scope(tmp_path, monkeypatch):
    d = make_model(tmp_path / "m")
    base = identity(d)["identity"]
    monkeypatch.setenv("ORBITKV_MODEL_FINGERPRINT", FINGERPRINT)
    op = identity(d)
    assert op["bytes_hashed"] == 0
    assert op["identity"] != base
    inputs = {i["name"]: i for i in op["inputs"]}
    assert inputs["model_artifacts"] == {
        "name": "model_artifacts",
        "source": "operator_fingerprint",
        "value": FINGERPRINT,
    }
    monkeypatch.setenv("ORBITKV_CACHE_SCOPE", "tenant-a")
    scoped = identity(d)
    assert scoped["identity"] != op["identity"]
    assert {i["name"]: i for i in scoped["inputs"]}["cache_scope"]["value"] == "tenant-a"


def test_uppercase_fingerprint_fails_closed(tmp_path, monkeypatch):
    d = make_model(tmp_path / "m")
    monkeypatch.setenv("ORBITKV_MODEL_FINGERPRINT", FINGERPRINT.upper())
    with pytest.raises(orbitkv.IdentityError, match="64 lowercase hex"):
        identity(d)
    with pytest.raises(ValueError):
        identity(d)


def test_hub_revision(tmp_path):
    d = make_model(tmp_path / "m")
    rev = "0123456789abcdef0123456789abcdef01234567"
    r = identity(d, hub_revision=rev)
    assert r["bytes_hashed"] == 0
    assert {i["name"]: i for i in r["inputs"]}["model_artifacts"]["source"] == "hub_revision"
    with pytest.raises(orbitkv.IdentityError, match="not a full 40-hex commit"):
        identity(d, hub_revision="main")


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"settings": {}}, "settings"),
        ({"settings": dict(SETTINGS, dtype=None)}, "`dtype` is null"),
        ({"representation": {"block_size": [1, None]}}, "is null"),
        ({"active_adapters": ["my-lora"]}, "active adapters are not supported"),
        ({"engine": "vLLM"}, "not a lowercase engine name"),
        ({"settings": {"x": b"bytes"}}, "settings: bytes is not JSON data"),
        ({"settings": ["not", "a", "map"]}, "settings: expected a dict, got list"),
    ],
)
def test_fail_closed_inputs(tmp_path, kw, message):
    d = make_model(tmp_path / "m")
    with pytest.raises(orbitkv.IdentityError, match=message):
        identity(d, **kw)


def test_directory_problems(tmp_path):
    with pytest.raises(orbitkv.IdentityError, match="config.json"):
        empty = tmp_path / "empty"
        empty.mkdir()
        identity(empty)
    no_weights = make_model(tmp_path / "nw")
    os.remove(no_weights / "model.safetensors")
    with pytest.raises(orbitkv.IdentityError, match="holds no weight files"):
        identity(no_weights)
    adapter = make_model(tmp_path / "adapter")
    (adapter / "adapter_config.json").write_text("{}")
    with pytest.raises(orbitkv.IdentityError, match="PEFT adapter"):
        identity(adapter)
    with pytest.raises(orbitkv.IdentityError):
        identity(tmp_path / "does-not-exist")
