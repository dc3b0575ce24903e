"""Our Triton kernels and their tile tables, testable and timed alone (tests/, bench/): they import
nothing of the engine, which chooses among them (engine/attention/, engine/moe/, engine/sampling.py,
engine/batch_invariant.py) and the model's quantized layers, which call the GEMV.

- triton_support.py: where the kernels can run, the GPU their tiles are chosen for, FP8 units.
- last_arrival.py: a split reduction added by its last program to finish, in one launch.
- weight_tiles.py: how every GEMM kernel reads a weight tile, in each storage format.
- rms_norm.py: an RMSNorm in one kernel, a row a program.
"""
