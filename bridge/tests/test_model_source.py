"""`orbitkv.model_source`: the one rule every adapter applies for where a
model's config.json is and whether its hub revision names the computation.
The hub cache is a real huggingface_hub layout in a temporary directory."""

from __future__ import annotations

import json

import pytest

import orbitkv

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"


@pytest.fixture
def no_fingerprint(monkeypatch):
    monkeypatch.delenv("ORBITKV_MODEL_FINGERPRINT", raising=False)


@pytest.fixture
def hub(tmp_path):
    """A hub cache holding org/model at COMMIT, which `main` points to."""
    repo = tmp_path / "hub" / "models--org--model"
    snap = repo / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return str(tmp_path / "hub")


def test_a_local_directory_is_used_as_it_is(tmp_path, no_fingerprint):
    assert orbitkv.model_source(str(tmp_path), "main") == (str(tmp_path), None)
    # The adapter's explicit directory wins over the engine's model name.
    assert orbitkv.model_source("org/model", None, model_dir=str(tmp_path)) == (str(tmp_path), None)
    with pytest.raises(orbitkv.IdentityError, match="not a directory"):
        orbitkv.model_source("org/model", COMMIT, model_dir=str(tmp_path / "none"))


def test_a_pinned_commit_is_read_from_the_local_cache_only(hub, no_fingerprint):
    d, commit = orbitkv.model_source("org/model", COMMIT, cache_dir=hub)
    assert d.endswith(f"snapshots/{COMMIT}") and commit == COMMIT
    # Git commits are case-insensitive: the identity takes the lower case.
    assert orbitkv.model_source("org/model", COMMIT.upper(), cache_dir=hub) == (d, COMMIT)
    # Pinned, but not downloaded: never fetched, an error saying so.
    with pytest.raises(orbitkv.IdentityError, match="no config.json in the local hub cache"):
        orbitkv.model_source("org/model", OTHER, cache_dir=hub)
    with pytest.raises(orbitkv.IdentityError, match="no config.json in the local hub cache"):
        orbitkv.model_source("org/absent", COMMIT, cache_dir=hub)


@pytest.mark.parametrize("revision", [None, "main", "v1.0", COMMIT[:12]])
def test_a_moving_revision_is_refused_without_the_operators_fingerprint(hub, no_fingerprint, revision):
    with pytest.raises(orbitkv.IdentityError, match="without a pinned commit") as info:
        orbitkv.model_source("org/model", revision, cache_dir=hub)
    assert "ORBITKV_MODEL_FINGERPRINT" in str(info.value)


def test_the_operators_fingerprint_names_the_computation_for_any_revision(hub, monkeypatch):
    monkeypatch.setenv("ORBITKV_MODEL_FINGERPRINT", "ab" * 32)
    # The config comes from what the ref points at; no commit enters the
    # identity (the fingerprint does).
    d, commit = orbitkv.model_source("org/model", None, cache_dir=hub)
    assert d.endswith(f"snapshots/{COMMIT}") and commit is None
    assert orbitkv.model_source("org/model", "main", cache_dir=hub) == (d, None)
