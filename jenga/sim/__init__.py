"""jenga.sim: a serving simulator comparing KV allocators on one GPU's memory (no torch).

Modules: `workloads` (seeded traces), `hardware` (GPU presets, step-time model),
`models` (model specs), `needs` (what each layer kind must keep: the waste reference),
`protocol` (the engine/allocator contract), `baselines` (paged baselines), `engine`
(continuous batching), `metrics` (summaries), `report` (table, JSON, plots), `cli`.
"""
