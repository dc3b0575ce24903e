"""The engine's memory: the KV in blocks and what reads and keeps it, and the encoder cache.

kv_blocks.py keeps the books (holders, free blocks, chained hashes), kv_store.py the tensors, in
bfloat16 or fp8 (kv_fp8.py); attention/ is how a forward attends over those blocks in place (the
store calls the chosen kernel, so it lives with the store); host_arena.py is the host tier,
host_copies.py the transfers to and from the device; prefix_cache.py matches, claims, publishes and
evicts each session's KV over all of them. encoder_cache.py keeps encoder outputs by content digest,
in memory and on disk: no KV. Nothing here imports the forwards or the scheduler."""
