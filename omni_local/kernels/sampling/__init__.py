"""The sampler's kernels, on a GPU (engine/forward/sampling.py chooses them, and is their reference):
uniform_noise.py, a batch's uniform numbers; fused_draw.py, a whole draw for a small vocabulary, one
program a row; hash32.py, the hash both share with the tensor ops."""
