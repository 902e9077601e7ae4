"""Scheduling and KV blocks, the scheduler's side of a step: which sequences run and how many tokens
each (scheduler.py), the paged KV blocks and their prefix cache (block_manager.py, prefix_cache.py,
kv_cache.py), the host and disk tiers (kv_tiers.py: the plan and the counters; kv_tier_planner.py on
the scheduler's side, kv_tier_store.py the bytes on the executor's), and KV blocks moved between
instances for prefill/decode disaggregation (kv_exchange.py, kv_transfer.py; kv_peer.py: the peer
secret that authenticates them).
"""
