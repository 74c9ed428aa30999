"""Serving with vLLM's engine: start-up, vLLM's block identity, computed-only caching, KV
events, the admission gate, the cache-creation metric, refusals, both model runners."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.integrations.vllm.conftest import VLLM_MISSING

pytest.importorskip("vllm", reason=VLLM_MISSING)

from integrations.vllm.errors import UnsupportedFeature
from integrations.vllm.harness import cases, engine, replay

import vmm
from integrations.vllm import compat, identity
from tests.integrations.vllm.test_activation import engine_request

BLOCK = 16


def _scheduler(model_dir: Path, memory_mb: int = 64, *, jenga: bool = True, **setup: Any) -> Any:
    setup.setdefault("max_model_len", 256)
    config = replay.make_vllm_config(model_dir, replay.SchedulerSetup(**setup))
    kv_config = replay.kv_cache_config_for(config, cases.layer_specs("llama"), memory_mb << 20)
    return replay.make_scheduler(config, kv_config, jenga=jenga)


def _request(rid: str, prompt: list[int], **kw: Any) -> Any:
    return compat.Request(
        request_id=rid,
        prompt_token_ids=list(prompt),
        sampling_params=compat.sampling_params(max_tokens=4, ignore_eos=True),
        pooling_params=None,
        block_hasher=compat.request_block_hasher(BLOCK, "sha256"),
        **kw,
    )


def _run(manager: Any, request: Any) -> None:
    """Admit, compute the whole prompt, cache it, finish (blocks stay cached)."""
    _, hit, _ = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - hit, hit) is not None
    request.num_computed_tokens = request.num_tokens
    manager.cache_blocks(request, request.num_tokens)
    manager.free(request)


def _hit(manager: Any, request: Any) -> int:
    return int(manager.get_computed_blocks(request)[1])


# -- 1. engine start-up -------------------------------------------------------------------
@pytest.mark.parametrize("kv_tensors", ["torch", "vmm"])
def test_vllms_engine_core_starts_and_steps_with_the_jenga_scheduler(
    model_dir: Path, kv_tensors: str
) -> None:
    setup = replay.SchedulerSetup(max_model_len=1024, jenga_options={"kv_tensors": kv_tensors})
    config = replay.make_vllm_config(model_dir, setup)
    config.scheduler_config.scheduler_cls = "integrations.vllm.scheduler.JengaScheduler"
    executor = engine.host_executor_class("gemma2", 48 << 20)
    core = compat.engine_core_class()(config, executor, log_stats=True)
    manager = core.scheduler.kv_cache_manager
    assert type(manager).__name__ == "JengaKVCacheManager"
    assert config.cache_config.effective_attention_block_size == BLOCK
    metadata = core.get_kv_cache_group_metadata()
    assert [m["block_size"] for m in metadata] == [BLOCK, BLOCK]
    assert sorted(m["sliding_window"] or 0 for m in metadata) == [0, 64]
    for i in range(3):
        prompt = [7] * 100 + [i + 1] * 50
        request = engine_request(f"r{i}", prompt)
        core.add_request(*core.preprocess_add_request(request))
    finished: set[str] = set()
    for _ in range(50):
        outputs, _ = core.step()
        for batch in outputs.values():
            finished.update(o.request_id for o in batch.outputs if o.finished)
        if finished == {"r0", "r1", "r2"}:
            break
    assert finished == {"r0", "r1", "r2"}
    assert manager.stats()["prefix.hit_tokens"] >= 2 * 96  # r1, r2 share r0's prefix
    worker = core.model_executor.worker
    if kv_tensors == "vmm":
        assert worker.kv_cache is not None and worker.kv_cache.mapped_bytes() > 0
    core.model_executor.shutdown()  # EngineCore.shutdown also tears down torch.distributed


# -- 2. block identity --------------------------------------------------------------------
PROMPT = [5] * 100


@pytest.mark.parametrize(
    "variant",
    ["lora", "cache_salt", "image", "prompt_embeds"],
)
def test_same_tokens_with_a_different_identity_never_share(model_dir: Path, variant: str) -> None:
    import torch

    manager = _scheduler(model_dir).kv_cache_manager

    def make(rid: str, which: int) -> Any:
        if variant == "lora":
            return _request(rid, PROMPT, lora_request=compat.lora_request(f"ad{which}", which + 1))
        if variant == "cache_salt":
            return _request(rid, PROMPT, cache_salt=f"tenant-{which}")
        if variant == "image":
            feature = compat.multimodal_feature(f"img-{which}", 10, 40, "image")
            return _request(rid, PROMPT, mm_features=[feature])
        torch.manual_seed(which)
        return _request(rid, [0] * 100, prompt_embeds=torch.randn(100, 8))

    _run(manager, make("a", 0))
    assert _hit(manager, make("same", 0)) == 96  # the same identity shares, as in vLLM
    assert _hit(manager, make("other", 1)) == 0


def test_blocks_are_named_by_vllms_digests_never_shared_across_lora_or_salt(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The core indexes vLLM's own digests: the same tokens under another LoRA adapter or
    cache salt are other blocks even with the core's salt forced equal (old: the core
    keyed token ids and salt, and a Python registry re-checked vLLM's digest)."""
    manager = _scheduler(model_dir).kv_cache_manager
    import integrations.vllm.lookup as lookup_module
    import integrations.vllm.manager as manager_module

    for module in (manager_module, lookup_module):  # the admission's and the lookup's
        monkeypatch.setattr(module, "request_salt", lambda request: 0, raising=False)
    a = _request("a", PROMPT, lora_request=compat.lora_request("ad0", 1))
    b = _request("b", PROMPT, lora_request=compat.lora_request("ad1", 2))
    c = _request("c", PROMPT, cache_salt="tenant")
    _run(manager, a)

    def match(prompt: list[int], digests: list[bytes]) -> int:
        return manager.allocator.prefix_match(prompt, digests=digests).hit

    assert match(PROMPT, digests=a.block_hashes) == 96
    assert match(PROMPT, digests=b.block_hashes) == match(PROMPT, digests=c.block_hashes) == 0
    assert _hit(manager, b) == _hit(manager, c) == 0
    assert _hit(manager, _request("d", PROMPT, lora_request=compat.lora_request("ad0", 1))) == 96


def test_a_hit_stops_at_the_first_digest_never_committed(model_dir: Path) -> None:
    """A lookup ends where the request's digests end or differ, as vLLM's does."""
    manager = _scheduler(model_dir).kv_cache_manager
    first = _request("a", PROMPT)
    _run(manager, first)
    assert manager.allocator.prefix_match(PROMPT, digests=first.block_hashes[:2]).hit == 2 * BLOCK
    forged = list(first.block_hashes)
    forged[3] = bytes(32)  # a digest the core never committed: the hit stops before it
    assert manager.allocator.prefix_match(PROMPT, digests=forged).hit == 3 * BLOCK


def test_identity_salt_folds_what_token_ids_do_not_carry() -> None:
    plain = SimpleNamespace(cache_salt=None, lora_request=None, prompt_embeds=None)
    salted = SimpleNamespace(cache_salt="x", lora_request=None, prompt_embeds=None)
    assert identity.request_salt(plain) == 0 and identity.request_salt(salted) != 0


# -- 3. only computed tokens enter the cache ------------------------------------------------
def test_a_replaced_sampled_token_never_enters_the_cache(model_dir: Path) -> None:
    """Streaming input: the chunk's last sampled token (never computed) is replaced by
    the continuation's input; a request with the old token must not hit that block."""
    manager = _scheduler(model_dir).kv_cache_manager
    session = _request("s", [3] * 31)
    assert manager.allocate_slots(session, 31) is not None
    session.num_computed_tokens = 31
    session.append_output_token_ids([999])  # sampled, not computed
    manager.cache_blocks(session, 31)
    # vLLM's _update_request_as_session: drop the sampled token, append the new input
    del session._all_token_ids[31:]
    del session.block_hashes[31 // BLOCK :]
    session._output_token_ids.clear()
    session.prompt_token_ids.extend([4] * 17)
    session._all_token_ids.extend([4] * 17)
    session.update_block_hashes()
    assert manager.allocate_slots(session, 17) is not None
    session.num_computed_tokens = 48
    manager.cache_blocks(session, 48)
    manager.free(session)
    stale = [3] * 31 + [999] + [4] * 18
    assert _hit(manager, _request("stale", stale)) == BLOCK
    assert _hit(manager, _request("fresh", [3] * 31 + [4] * 18)) == 3 * BLOCK


# -- 4. events, admission gate, retention, cache-creation metric ---------------------------
def test_kv_events_are_vllms(model_dir: Path) -> None:
    manager = _scheduler(model_dir, memory_mb=8).kv_cache_manager
    manager.enable_kv_cache_events = True
    request = _request("a", list(range(100)))
    _run(manager, request)
    stored = [e for e in manager.take_events() if isinstance(e, compat.BlockStored)]
    digests = [compat.maybe_convert_block_hash(h) for h in request.block_hashes]
    assert [h for e in stored for h in e.block_hashes] == digests  # one event per commit
    assert stored[0].parent_block_hash is None
    # fill the cache with other prompts until a's blocks are evicted
    for i in range(40):
        _run(manager, _request(f"x{i}", [1000 + i] * 100))
    removed = {
        e.block_hashes[0] for e in manager.take_events() if isinstance(e, compat.BlockRemoved)
    }
    assert digests[0] in removed
    assert manager.reset_prefix_cache()
    assert any(isinstance(e, compat.AllBlocksCleared) for e in manager.take_events())


def test_full_sequence_must_fit_gates_admission(model_dir: Path) -> None:
    manager = _scheduler(model_dir, memory_mb=40, max_model_len=2048).kv_cache_manager
    capacity = manager.layout.groups[0].capacity * BLOCK  # tokens the cache can hold
    running = _request("running", [2] * (capacity - 1800 + 4 * BLOCK))
    assert manager.allocate_slots(running, running.num_tokens) is not None
    request = _request("long", [1] * 1800)  # its first chunk fits, its whole prompt not
    assert manager.allocate_slots(request, 256, full_sequence_must_fit=True) is None
    assert manager.allocate_slots(request, 256) is not None


@pytest.mark.parametrize("caching", [True, False])
def test_cache_creation_tokens_match_vllms_manager(model_dir: Path, caching: bool) -> None:
    ours = _scheduler(model_dir, enable_prefix_caching=caching).kv_cache_manager
    theirs = _scheduler(model_dir, enable_prefix_caching=caching, jenga=False).kv_cache_manager
    for manager in (ours, theirs):
        request = _request("a", list(range(100)))
        assert manager.allocate_slots(request, 100) is not None
        request.num_computed_tokens = 100
        manager.cache_blocks(request, 100)
        assert manager.estimate_cached_tokens(request) == (96 if caching else 0)


# -- 5. both model runners ----------------------------------------------------------------
@pytest.mark.parametrize("geometry", ["per_group", "slots"])
def test_the_v2_runners_kv_cache_init_builds_vmm_tensors(model_dir: Path, geometry: str) -> None:
    """vLLM's V2 `init_kv_cache` (what ``GPUModelRunner.initialize_kv_cache`` calls) with
    the plugin's swap: its per-layer caches are the VMM ranges' views (per_group: one
    range per group; slots: vLLM's buffer on one range); and `register` wraps the V2
    runner's initialisation and step."""
    import torch

    from integrations.vllm import plugin

    plugin.register()
    v2 = compat.v2_model_runner_module().GPUModelRunner
    assert getattr(v2.initialize_kv_cache, "_jenga_vmm_wrapped", False)
    assert getattr(v2.execute_model, "_jenga_vmm_wrapped", False)
    options = {"kv_tensors": "vmm", "geometry": geometry}
    setup = replay.SchedulerSetup(max_model_len=1024, jenga_options=options)
    config = replay.make_vllm_config(model_dir, setup)
    kv_config = replay.kv_cache_config_for(config, cases.layer_specs("gemma2"), 48 << 20)
    attn_utils = compat.v2_attn_utils_module()
    made: list[Any] = []
    backend = vmm.HostBackend(2 << 20, capacity=64 << 20)
    with plugin.vmm_allocation(attn_utils, config, made, backend=backend):
        caches = attn_utils.init_kv_cache({}, kv_config, torch.device("cpu"), [BLOCK] * 2, config)
    assert len(made) == 1
    ours = made[0]
    assert {n: c.data_ptr() for n, c in caches.items()} == {
        n: ours.kv_caches[n].data_ptr() for n in caches
    }
    ranges = [rng.va for rng in ours.ranges.values()]
    if geometry == "per_group":
        assert len(ranges) == len(kv_config.kv_cache_groups)  # one range per group
        assert {c.data_ptr() for c in caches.values()} >= set(ranges)  # each group's layer 0
    else:  # every group's layer 0 at the start of the one range, as in vLLM's buffer
        (rng,) = ours.ranges.values()
        assert all(rng.va <= c.data_ptr() < rng.va + rng.size for c in caches.values())
        assert sum(c.data_ptr() == rng.va for c in caches.values()) == 2
    made[0].close()


def test_a_runner_whose_allocation_is_unreachable_refuses_vmm_tensors(model_dir: Path) -> None:
    """Never a silent fallback: with no ``allocate_kv_cache`` to swap, a ``kv_tensors:
    "vmm"`` start-up raises naming the runner and how to pick the other one."""
    from integrations.vllm import plugin

    class Runner:
        def __init__(self, vllm_config: Any) -> None:
            self.vllm_config = vllm_config

        def initialize_kv_cache(self, kv_cache_config: Any) -> str:
            return "vLLM's tensors"

        def execute_model(self, scheduler_output: Any) -> None:
            return None

    plugin._wrap_runner(Runner, "initialize_kv_cache", SimpleNamespace())
    torch_config = replay.make_vllm_config(model_dir, replay.SchedulerSetup())
    assert Runner(torch_config).initialize_kv_cache(None) == "vLLM's tensors"
    setup = replay.SchedulerSetup(jenga_options={"kv_tensors": "vmm"})
    vmm_config = replay.make_vllm_config(model_dir, setup)
    with pytest.raises(UnsupportedFeature, match=r"Runner.*VLLM_USE_V2_MODEL_RUNNER=0"):
        Runner(vmm_config).initialize_kv_cache(None)
