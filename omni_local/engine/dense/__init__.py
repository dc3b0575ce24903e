"""Our kernels for the dense layers (the attention projections): a few rows times a quantized weight.

- `quantized_gemv` (gemv.py): rows [M, K] of a decode batch times an fp8 or int8 weight [N, K]
  with one scale a row, the weight's bytes read once and converted as they are loaded; registered
  as the torch op `omni_local::quantized_gemv`. It imports Triton, so it is imported only on CUDA
  (model/quantized/linear.py decides, once a layer's weight is on its device).
- gemv_tiles.py: its tile, per weight shape.
"""
