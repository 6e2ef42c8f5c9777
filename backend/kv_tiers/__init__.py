"""Tiers of the prefix cache below the KV pool: host RAM (memory_tier) and disk (disk_tier),
memory first (tiered_store), holding full blocks the pool evicted as checksummed bytes
(block_codec) of one model (fingerprint), keyed by their chain hashes. docs/kv_tiers.md."""
