"""jenga: the two-level LCM allocator for heterogeneous KV caches. Integers only, no torch."""
