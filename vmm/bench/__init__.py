"""vmm-bench: per-op latency of the vmm layer beside a raw baseline (design note in `cli`).

Modules: `cli` (flags, cases, bars, the `vmm-bench` entry point), `host` (host-backend
cases), `cuda` (driver cases), `report` (results, table, JSON), `stats` (timing loops
and avg/p50/p99/max summaries, shared with every script under benchmarks/).
"""
