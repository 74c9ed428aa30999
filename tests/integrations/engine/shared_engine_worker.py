"""A mini engine process on a shared pool (for test_shared_pool.py).

argv: POOL NAME LAYERS MIN_BYTES [CACHE] (a tiny Llama of LAYERS layers; CACHE "1": the
prefix cache on). Prints {"ready": ...}, then per stdin line {"burst": k, "seed": s}: serves
k requests at once, and answers with the peak of chunks held during the burst, the chunks
held after it, and whether every output equals `generate` (then reports its cached bytes
to the owner); {"stats": 1}: the chunks held and the cached-page chunks given to reclaims.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def main(pool: str, name: str, layers: int, min_bytes: int, cache: bool) -> None:
    sys.path.insert(0, str(ROOT))
    import torch
    import transformers

    from integrations.engine import EngineConfig, MiniEngine
    from tests.integrations.engine.test_engine import CHUNK, SMALL, reference

    torch.manual_seed(layers)
    config = transformers.LlamaConfig(**{**SMALL, "num_hidden_layers": layers})
    model = transformers.LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    config = EngineConfig(chunk_bytes=CHUNK, block_size=4, use_prefix_cache=cache,
                          max_running=8, token_budget=64, shared_pool=pool, tenant_name=name,
                          tenant_min_bytes=min_bytes)  # fmt: skip
    engine = MiniEngine(model, config)
    tenant = engine.pool.backend.tenant  # type: ignore[attr-defined]
    print(json.dumps({"ready": True, "max": tenant.max_bytes}), flush=True)
    for line in sys.stdin:
        t0 = time.monotonic()
        cmd = json.loads(line)
        if "stats" in cmd:
            with engine.gate.lock:  # type: ignore[union-attr]
                stats = {"held": tenant.held_chunks, "evicted": engine.gate.evicted_chunks}  # type: ignore[union-attr]
            print(json.dumps(stats), flush=True)
            continue
        gen = torch.Generator().manual_seed(cmd["seed"])
        requests = []
        for i in range(cmd["burst"]):
            prompt = torch.randint(0, 128, (30 + 4 * i,), generator=gen).tolist()
            rid = f"{cmd['seed']}-{i}"
            requests.append((rid, prompt, 8, 0))
            engine.add_request(rid, prompt, 8, arrival_step=engine.step_index)
        peak = 0
        while engine.waiting or engine.running or engine.pending:
            engine.step()
            peak = max(peak, tenant.held_chunks)
        engine.kv.check_invariants(expensive=True)
        t1 = time.monotonic()
        want = reference(model, requests)
        match = all(engine.done[rid].output == want[rid] for rid, *_ in requests)
        out = {"peak": peak, "held": tenant.held_chunks, "match": match,
               "serve_s": t1 - t0, "reference_s": time.monotonic() - t1}  # fmt: skip
        engine.gate.report()  # type: ignore[union-attr]
        print(json.dumps(out), flush=True)
    engine.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:] == ["1"])
