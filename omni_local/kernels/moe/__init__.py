"""Our Triton kernels for the MoE forward, in the order a layer runs them:

1. routing.py: softmax, top-k and renormalisation of the router's logits, a tile of tokens a program.
2. sorting.py: the (token, k) pairs sorted by expert into blocks of BLOCK_M rows, each expert's
   run padded to a whole block, with fixed-size output (no host sync): in one single-program launch
   for a few pairs, in three launches over chunks of pairs for a prefill, to the same rows.
   route_and_sort.py: 1 and 2 in one launch for a decode batch (up to 16 tokens).
3. gate_up.py: each block's rows times its expert's gate and up projections, SiLU(gate) * up in the
   epilogue.
4. down.py: the down projection, each row scaled by its routing weight in the epilogue, written to
   the pair's own row: the top-k sum is then a fixed-order sum over k (see routed_experts.py).
pairs.py: 3 and 4 for int4 experts at up to a few tokens, one program per pair and column tile,
   after 1 alone (no sort): each pair's expert rows read as a GEMV reads them.

They take float32, float16 and bfloat16; Triton's CPU interpreter (TRITON_INTERPRET=1, the tests)
multiplies bfloat16 wrongly, so it is tested there in float32 and float16.
"""
