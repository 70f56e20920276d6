"""The recovery contract functions against docs/contract.md."""

from __future__ import annotations

import pytest

import orbitkv

NS = "ab" * 32


def spec_contract(**overrides):
    c = {
        "namespace": NS,
        "page_tokens": 64,
        "groups": [
            {"id": 0, "rule": "prefix", "components": ["attention_kv"]},
            {"id": 1, "rule": {"window": 100}, "components": ["sliding_window_kv"]},
            {
                "id": 2,
                "rule": "checkpoint",
                "components": ["recurrent_checkpoint", "convolution_state"],
            },
        ],
    }
    c.update(overrides)
    return c


def bundle(g0, g1, g2, start=128, end=512, namespace=NS):
    return {
        "namespace": namespace,
        "start": start,
        "end": end,
        "groups": [
            {"group": 0, "page_ends": g0},
            {"group": 1, "page_ends": g1},
            {"group": 2, "page_ends": g2},
        ],
    }


def test_required_ranges_spec_example():
    c = spec_contract()
    assert orbitkv.required_ranges(c, 128, 512) == [(0, 128, 512), (1, 384, 512), (2, 448, 512)]
    # A one-page span: every group needs exactly that page.
    assert orbitkv.required_ranges(c, 128, 192) == [(0, 128, 192), (1, 128, 192), (2, 128, 192)]
    # An empty span gives (g, start, start).
    assert orbitkv.required_ranges(c, 128, 128) == [(0, 128, 128), (1, 128, 128), (2, 128, 128)]
    assert orbitkv.required_ranges(c, 128, 512, namespace=NS)[0] == (0, 128, 512)


def test_required_ranges_errors():
    c = spec_contract()
    with pytest.raises(orbitkv.ContractError, match="start 100 is not aligned to 64-token pages"):
        orbitkv.required_ranges(c, 100, 512)
    with pytest.raises(orbitkv.ContractError, match="span start 512 is after end 128"):
        orbitkv.required_ranges(c, 512, 128)
    with pytest.raises(orbitkv.ContractError, match="namespace mismatch"):
        orbitkv.required_ranges(c, 128, 512, namespace="cd" * 32)
    with pytest.raises(orbitkv.ContractError, match="namespace"):
        orbitkv.required_ranges(c, 128, 512, namespace="not hex")
    with pytest.raises(orbitkv.ContractError, match="contract: expected a dict, got list"):
        orbitkv.required_ranges([NS, 64, []], 0, 64)
    # ContractError is a ValueError.
    with pytest.raises(ValueError):
        orbitkv.required_ranges(c, 1, 64)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"page_tokens": 0}, "page_tokens is 0"),
        ({"groups": []}, "contract declares no groups"),
        ({"namespace": "00" * 32}, "empty"),
        (
            {
                "groups": [
                    {"id": 0, "rule": "checkpoint", "components": ["recurrent_checkpoint"]},
                    {"id": 1, "rule": "prefix", "components": ["attention_kv"]},
                ]
            },
            "group 0 must be a prefix group, not checkpoint",
        ),
        (
            {"groups": [{"id": 0, "rule": "prefix", "components": ["attention_kv", "dsa"]}]},
            "group 0: unsupported component dsa",
        ),
        (
            {"groups": [{"id": 0, "rule": "prefix", "components": ["sliding_window_kv"]}]},
            "cannot be recovered by the prefix rule",
        ),
        ({"extra": True}, "unknown field `extra`"),
        ({"page_tokens": "64"}, "invalid type: string"),
    ],
)
def test_bad_contracts(overrides, message):
    with pytest.raises(orbitkv.ContractError, match=message):
        orbitkv.required_ranges(spec_contract(**overrides), 0, 64)


def test_restorable_boundaries():
    c = spec_contract()
    # 320: the window needs pages 256 and 320, the checkpoint needs 320.
    # 384: the checkpoint page 384 is missing. 192, 256: the window lacks 192.
    b = bundle([192, 256, 320, 384], [256, 320, 384], [320])
    assert orbitkv.restorable_boundaries(c, b) == [320]
    b = bundle([192, 256, 320, 384], [256, 320, 384], [320, 384])
    assert orbitkv.restorable_boundaries(c, b) == [320, 384]
    # docs/contract.md's bundle: only group 0 holds pages, nothing is legal.
    assert orbitkv.restorable_boundaries(c, bundle([192, 256], [], [])) == []


@pytest.mark.parametrize(
    "b, message",
    [
        (bundle([192, 192], [], []), "page end 192 does not follow 192"),
        (bundle([200], [], []), "page end 200 is not page-aligned"),
        (bundle([576], [], []), "page end 576 is outside \\(128, 512\\]"),
        (bundle([], [], [], namespace="cd" * 32), "namespace mismatch"),
        (
            {"namespace": NS, "start": 128, "end": 512, "groups": [{"group": 0, "page_ends": []}]},
            "bundle omits registered group 1",
        ),
        ({"namespace": NS, "start": 128, "end": 512}, "missing field `groups`"),
    ],
)
def test_bad_bundles(b, message):
    with pytest.raises(orbitkv.ContractError, match=message):
        orbitkv.restorable_boundaries(spec_contract(), b)


def test_common_and_select():
    c = spec_contract()
    r0 = bundle([192, 256, 320, 384], [256, 320, 384], [320, 384])
    r1 = bundle([192, 256, 320, 384], [256, 320, 384], [320])
    common = orbitkv.common_boundaries(c, [r0, r1])
    assert common == [320]
    assert orbitkv.common_boundaries(c, [r0]) == [320, 384]
    assert orbitkv.common_boundaries(c, []) == []
    with pytest.raises(orbitkv.ContractError, match="ranks disagree on the queried span"):
        orbitkv.common_boundaries(c, [r0, bundle([192], [192], [192], start=128, end=448)])

    # The final prompt token is always computed by the engine.
    assert orbitkv.select_boundary([320, 384], 385) == 384
    assert orbitkv.select_boundary([320, 384], 384) == 320
    assert orbitkv.select_boundary([320], 320) is None
    assert orbitkv.select_boundary([], 1000) is None
    assert orbitkv.select_boundary([320], 0) is None


def test_vllm_window_past_tokens():
    assert orbitkv.vllm_window_past_tokens(101) == 100
    assert orbitkv.vllm_window_past_tokens(2) == 1
    with pytest.raises(orbitkv.ContractError, match="keeps no past token"):
        orbitkv.vllm_window_past_tokens(1)
    # The vLLM value feeds a window rule.
    c = spec_contract()
    c["groups"][1]["rule"] = {"window": orbitkv.vllm_window_past_tokens(101)}
    assert orbitkv.required_ranges(c, 128, 512)[1] == (1, 384, 512)
