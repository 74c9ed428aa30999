"""vmm-bench: per-op latency of the vmm layer beside a raw baseline (design note in `cli`).

Modules: `cli` (flags, cases, bars, the `vmm-bench` entry point), `host` (host-backend
cases and the shared timing loops), `cuda` (driver cases), `report` (summaries, table, JSON).
"""
