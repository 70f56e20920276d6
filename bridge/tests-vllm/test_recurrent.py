"""Hybrid recurrent models through the real vLLM 0.33 classes: a
Qwen3-Next-style config (three gated-delta-net layers to one full
attention layer) and a Granite-4-style one (three Mamba2 layers to one
attention layer; Mamba2 exports a block-boundary state from inside a
prefill into a reserved checkpoint block), grouped by vLLM's own
`get_kv_cache_groups`, with the state shapes and dtypes from vLLM's own
model classes, in vLLM's `mamba_cache_mode="align"`. The stand-in forward checks, at every step,
that a request resumes from exactly the state of the tokens before it (as
`preprocess_mamba` reads it) and writes the state after its step where
align mode keeps it; so a restored recurrent state that is not the
producer's, or an attention prefix restored without its state, fails the
step that resumes from it."""

from __future__ import annotations

import dataclasses

import pytest
from harness import engine
from test_connector import no_leaks, produce_then_consume
from tiny_models import make_hybrid

PROMPT = [10 + (i * 7) % 400 for i in range(140)]


FAMILIES = ["qwen3_next", "granite4"]


@pytest.fixture(scope="session")
def recurrent_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("recurrent")
    made = {}

    def get(family: str):
        if family not in made:
            made[family] = make_hybrid(root / family, family)
        return made[family]

    return get


@pytest.fixture(scope="session")
def qwen3_next(recurrent_models):
    return recurrent_models("qwen3_next")


# "chunked": 64-token chunks, the state at 128 is where a chunk ends;
# "one pass": the whole prompt in one step, the state at 128 exported from
# inside it (Mamba2's checkpoint block; the delta net splits at 128).
@pytest.mark.parametrize("max_batched", [64, 256], ids=["chunked", "one-pass"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_prefix_loads_its_attention_pages_and_the_state_at_the_boundary(
    recurrent_models, manager, family, max_batched
):
    with engine(recurrent_models(family), manager.socket, num_blocks=256, max_batched=max_batched) as e:
        kinds = [type(g.kv_cache_spec).__name__ for g in e.kcc.kv_cache_groups]
        assert sorted(kinds) == ["FullAttentionSpec"] + ["MambaSpec"] * 3, kinds
        spec = e.connector.spec
        assert [g.kind for g in spec.groups] == ["full", "mamba", "mamba", "mamba"]
        assert [g["rule"] for g in spec.description.groups] == ["prefix"] + ["checkpoint"] * 3
        hit = produce_then_consume(e, PROMPT, tail=(99, 98))
        assert hit == 128, e.stats
        w = e.workers[0].worker.stats
        # 8 attention pages and, per recurrent group, the one state at 128.
        assert w.pages_loaded == 8 + 3 and w.loads_failed == 0, w
        e.check_null_block()
    no_leaks(manager)


def _withhold(e, boundaries, rank=None):
    """Drops the recurrent state pages ending at `boundaries` from the saves
    (every rank's, through the scheduler's hand-offs, or one rank's, at its
    worker): the attention pages are still saved."""
    recurrent = {g.vllm_group for g in e.connector.spec.groups if g.kind == "mamba"}
    page = e.connector.spec.page_tokens
    if rank is None:
        sched = e.connector.scheduler
        real = sched._state_handoffs

        def handoffs(so):
            got = real(so)
            return {
                rid: {k: b for k, b in per.items() if k[1] not in boundaries}
                for rid, per in got.items()
            }

        sched._state_handoffs = handoffs
        return
    w = e.workers[rank].worker
    real_gather = w._gather

    def gather(save):
        return real_gather(save.without(lambda p, vg: vg in recurrent and (p + 1) * page in boundaries))

    w._gather = gather


def _consume(e, prompt, tail=(99, 98)):
    """B (`prompt` + `tail`) after the local prefix cache and the KV are
    wiped: the tokens it loads from OrbitKV."""
    assert e.sched.reset_prefix_cache()
    e.wipe()
    before = e.stats.hit_tokens
    e.add("B", list(prompt) + list(tail))
    e.run()
    return e.stats.hit_tokens - before


def _produce_two(e):
    """vLLM keeps a prompt's state at its last page boundary below its last
    token (and where a chunk ends on a page boundary): A1 (the first 72
    tokens) leaves one at 64, A2 (all 140, its first 64 from vLLM's own
    prefix cache, resumed from that state) one at 128."""
    e.add("A1", PROMPT[:72])
    e.run()
    e.add("A2", PROMPT)
    e.run()


@pytest.mark.parametrize("family", FAMILIES)
def test_a_prefix_whose_last_state_is_missing_resumes_at_the_state_before(recurrent_models, manager, family):
    # Without the state at 128 the longest attention prefix (8 pages) is
    # not a boundary: B resumes at 64, from the state at 64, and computes
    # the rest (the oracle checks the state it resumes from).
    with engine(recurrent_models(family), manager.socket, num_blocks=256) as e:
        _withhold(e, {128})
        _produce_two(e)
        assert _consume(e, PROMPT) == 64, e.stats
        w = e.workers[0].worker.stats
        assert w.pages_loaded == 4 + 3 and w.loads_failed == 0, w
        e.check_null_block()
    no_leaks(manager)


@pytest.mark.parametrize("family", FAMILIES)
def test_an_attention_prefix_without_any_state_is_a_miss_never_an_attention_only_load(
    recurrent_models, manager, family
):
    with engine(recurrent_models(family), manager.socket, num_blocks=256) as e:
        _withhold(e, set(range(0, 4096, 16)))
        _produce_two(e)
        assert _consume(e, PROMPT) == 0, e.stats
        assert e.workers[0].worker.stats.pages_loaded == 0
        assert e.stats.misses_by_reason.get("incomplete_group", 0) >= 1, e.stats
        # The attention pages are stored: the miss is the contract's.
        s = e.connector.scheduler.link.session
        hashes = [bytes(h) for h in e.hasher(_request(PROMPT))][:8]
        located = s.locate(hashes)
        assert located.tokens == 0 and str(located.miss) == "incomplete_group", located
    no_leaks(manager)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_rank_missing_a_state_gives_the_boundary_every_rank_holds(recurrent_models, manager, family):
    with engine(recurrent_models(family), manager.socket, num_blocks=256, tp=2) as e:
        _withhold(e, {128}, rank=1)
        _produce_two(e)
        assert _consume(e, PROMPT) == 64, e.stats
        for rank in (0, 1):
            w = e.workers[rank].worker.stats
            assert w.pages_loaded == 4 + 3 and w.loads_failed == 0, (rank, w)
        e.check_null_block()
    no_leaks(manager)


def _request(prompt):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(
        request_id="probe",
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
    )


def test_the_recurrent_state_representation_is_part_of_the_identity(qwen3_next):
    import orbitkv.vllm as ov
    from harness import build_config

    def identity(mutate=None):
        vc, kcc, _ = build_config(qwen3_next, "/nonexistent.sock")
        if mutate is not None:
            mutate(vc, kcc)
        settings = ov.ConnectorSettings.from_extra_config(vc.kv_transfer_config.kv_connector_extra_config)
        return ov.resolve_engine(vc, kcc, settings).identity

    base = identity()
    assert identity() == base

    def ssm_dtype(vc, kcc):
        vc.cache_config.mamba_ssm_cache_dtype = "float16"

    def conv_dtype(vc, kcc):
        vc.cache_config.mamba_cache_dtype = "float16"

    def shapes(vc, kcc):
        for g in kcc.kv_cache_groups:
            if type(g.kv_cache_spec).__name__ == "MambaSpec":
                g.kv_cache_spec = dataclasses.replace(
                    g.kv_cache_spec, shapes=((4, 47), *g.kv_cache_spec.shapes[1:])
                )

    for mutate in (ssm_dtype, conv_dtype, shapes):
        assert identity(mutate) != base, mutate.__name__



def test_a_mamba_spec_field_the_connector_does_not_know_is_refused(qwen3_next, monkeypatch):
    # A vLLM that adds a field to MambaSpec (stands in: a field this
    # connector is made not to know) is refused, naming it; so is a spec
    # class of its own.
    import orbitkv.vllm as ov
    import orbitkv.vllm.engine as eng
    from harness import build_config
    from vllm.v1.kv_cache_interface import MambaSpec

    vc, kcc, _ = build_config(qwen3_next, "/nonexistent.sock")
    settings = ov.ConnectorSettings.from_extra_config(vc.kv_transfer_config.kv_connector_extra_config)
    monkeypatch.setattr(eng, "_MAMBA_SPEC_FIELDS", eng._MAMBA_SPEC_FIELDS - {"tp_replicated"})
    with pytest.raises(ov.ConfigError, match="tp_replicated"):
        ov.resolve_engine(vc, kcc, settings)
    monkeypatch.undo()

    @dataclasses.dataclass(frozen=True)
    class NewerMambaSpec(MambaSpec):
        state_quantization: str = "fp8"

    for g in kcc.kv_cache_groups:
        if isinstance(g.kv_cache_spec, MambaSpec):
            fields = {f.name: getattr(g.kv_cache_spec, f.name) for f in dataclasses.fields(MambaSpec) if f.init}
            g.kv_cache_spec = NewerMambaSpec(**fields)
    with pytest.raises(ov.ConfigError, match="NewerMambaSpec"):
        ov.resolve_engine(vc, kcc, settings)


def test_recurrent_states_reach_vllms_events_as_mamba_pages(qwen3_next, orbitkv_bin):
    # With the manager's stream and vLLM's publisher on, the state pages
    # a hybrid stores are advertised with their own group and kind: a
    # router sees the checkpoint a prefix needs, not the attention pages
    # alone.
    import time

    import msgspec
    import serve_support as ss
    from test_events import subscriber
    from vllm.config.kv_events import KVEventsConfig
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    m = ss.Manager(orbitkv_bin, dram="64MiB")
    m.pub, m.rep = f"ipc://{m.dir}/events", f"ipc://{m.dir}/replay"
    m.config.write_text(ss.CONFIG + f'[events]\npublish = "{m.pub}"\nreplay = "{m.rep}"\n')
    vllm_pub = f"ipc://{m.dir}/vllm-events"
    kve = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=vllm_pub)
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    got = []
    with ss.running(m):
        sub = subscriber(vllm_pub)
        try:
            extra = {"events": m.pub, "events_replay": m.rep}
            with engine(qwen3_next, m.socket, num_blocks=256, extra=extra, kv_events=kve) as e:
                time.sleep(0.3)
                e.add("A", PROMPT)
                e.run()
                mamba = [g for g in e.connector.spec.groups if g.kind == "mamba"]

                def drain():
                    while sub.poll(0):
                        _, _, payload = sub.recv_multipart()
                        got.extend(
                            ev
                            for ev in decoder.decode(payload).events
                            if isinstance(ev, BlockStored) and ev.medium == "CPU"
                        )

                def states():
                    return [ev for ev in got if ev.kv_cache_spec_kind == "mamba"]

                e.run(until=lambda: drain() or len(states()) >= len(mamba))
                assert sorted(ev.group_idx for ev in states()) == sorted(g.vllm_group for g in mamba)
                # Each is the page ending at 128: the eighth block hash.
                h = e.hasher(_request(PROMPT))[7]
                from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

                assert all(ev.block_hashes == [maybe_convert_block_hash(h)] for ev in states())
                attention = [ev for ev in got if ev.kv_cache_spec_kind == "full_attention"]
                assert len(attention) == 8
        finally:
            sub.close(0)
