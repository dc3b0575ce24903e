"""Our Triton kernels and their tile tables, tested and timed alone (tests/, bench/). They import
nothing of the engine or the model: the engine chooses among them (engine/memory/attention/, engine/forward/moe/,
engine/forward/sampling.py, engine/forward/batch_invariant.py), and the model's quantized layers call the GEMV.

- attention/: a decode step's attention over the KV blocks in place (paged.py), the layer's q_norm
  and rotation applied as it loads the queries (QueryNormRope).
- moe/: the MoE experts' kernels (routing, the sort by expert, gate_up, down, and by pair for a few
  tokens), run as one op by routed_experts.py, with their tuned tiles (tile_configs.py, tile_configs/).
- sampling/: the sampler's uniform numbers and a small vocabulary's whole draw, and the hash they
  share with engine/forward/sampling.py's tensor ops (hash32.py).
- triton_support.py: where the kernels can run, the GPU their tiles are chosen for, FP8 units.
- last_arrival.py: a split reduction added by its last program to finish, in one launch.
- weight_tiles.py: how every GEMM kernel reads a weight tile, in each storage format.
- rms_norm.py: an RMSNorm in one kernel, a row a program.
- gemv.py: a few rows times a weight, quantized (fp8, int8, int4) or not, the weight read once in its
  stored bytes: the quantized attention projections and the routers at decode batch sizes, and any
  weight at any row count in one order (the deterministic setting); gemv_tiles.py: its tile, per
  weight shape.
"""
