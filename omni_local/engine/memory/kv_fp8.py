"""The KV in fp8 (the `kv_dtype = "fp8"` setting), the Thinker's and the Talker's: float8 e4m3 keys and
values with a float32 scale per (token, kv head), half the bytes of bfloat16 a token (plus 4 bytes a
scale).

A scale per token and head, written with the token: quantizing a row needs no other row, so a
token's stored values are the same however its prompt was split into forwards (a chunk, a tail on a
cached prefix, a decode step, a graphed batch), and no block is ever quantized again as it fills (a
scale per block would change with each row written into it). That keeps the prefix cache exact: a
cached prefix holds the values a cold prefill of the same tokens writes. It also follows each token's
own range (keys after k_norm and rotation, values unnormed), where one scale for the model would
clip or waste range. The arithmetic is the fp8 weights' (model/quantized/formats.py): the row's
largest magnitude maps to 448, and a read is values x scale in float32, rounded once to the model's
dtype, by our attention kernel and the torch path alike.

Every reader attends over those dequantized values, a forward's own new rows too (kv_store.py):
otherwise a first prefill would attend over its keys in full precision and a later turn over the
same keys quantized, and a cached turn would differ from the same turn computed.
"""

import torch

from omni_local.kernels.triton_support import refuse_without_fp8
from omni_local.model.quantized.formats import FP8, Quantized, dequantize, quantize

SCALE_DTYPE = torch.float32  # formats.py's fp8 scales
SCALE_BYTES = SCALE_DTYPE.itemsize


def fp8_kv(setting: str, device: torch.device) -> bool:
    """Whether `kv_dtype` (`setting`) keeps the KV in fp8 on `device`: 'fp8' on a GPU with FP8 (compute
    capability 8.9 or newer), and on the CPU (torch's conversions; the tests); a SettingsError below 8.9
    naming the default, and int4 weights for the memory fp8 KV would have saved."""
    if setting != "fp8":
        return False
    refuse_without_fp8("setting 'kv_dtype' is 'fp8'", "use kv_dtype = 'auto' (the default; weights = 'int4' "
                       "leaves the KV more memory)", device)
    return True


def write_rows(pool: torch.Tensor, scales: torch.Tensor | None, blocks: torch.Tensor, offsets: torch.Tensor,
               rows: torch.Tensor) -> None:
    """`rows` [n, kv_heads, head_dim] into row `offsets[i]` of block `blocks[i]` of `pool` [blocks,
    kv_heads, block_tokens, head_dim]; an fp8 pool's quantized, with each row's scale into `scales`
    [blocks, kv_heads, block_tokens]."""
    if scales is None:
        pool[blocks, :, offsets] = rows
        return
    quantized = quantize(rows, "fp8")
    pool[blocks, :, offsets] = quantized.values
    scales[blocks, :, offsets] = quantized.scales


def read_rows(values: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Rows [..., head_dim] read from a pool (with their `scales` [...], an fp8 pool's) in `dtype`."""
    if scales is None:
        return values
    return dequantize(Quantized("fp8", values, scales), dtype)


def empty_pools(shape: tuple[int, ...], fp8: bool, dtype: torch.dtype, device: torch.device, zeroed: bool
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The storage of pools of `shape` [..., head_dim] in `dtype`, or of fp8 pools (bytes: torch's CPU
    kernels fill and index-copy no float8, and a byte copy is exact; `as_pools` views them as fp8)
    with their scales [...]. Zeros with `zeroed` (a zero scale reads as zero), else uninitialised."""
    make = torch.zeros if zeroed else torch.empty
    if not fp8:
        return make(shape, dtype=dtype, device=device), None
    return make(shape, dtype=torch.uint8, device=device), make(shape[:-1], dtype=SCALE_DTYPE, device=device)


def as_pools(storage: torch.Tensor) -> torch.Tensor:
    """`empty_pools`'s storage as the pools attention reads: fp8 where it is bytes."""
    return storage.view(FP8) if storage.dtype == torch.uint8 else storage
