"""How far fp8 KV (`kv_dtype = "fp8"`, engine/memory/kv_fp8.py) moves the Thinker from KV in the model's dtype.

    python -m omni_local.bench.kv_quality                    # the demo model
    python -m omni_local.bench.kv_quality --wide-demo        # its variant of 256-wide rows
    python -m omni_local.bench.kv_quality --attention-only --device cuda --dtype bfloat16

Replies: the app is started twice with the same settings, KV in the model's dtype ('auto') and in
fp8, the prefix cache off; each writes a greedy reply of up to --new-tokens to each of weight_quality's
prompts (text, an image, a clip), and the fp8 reply is compared with the other: the tokens before the
first that differs, and the share of equal positions (a reply that ends early counts its missing
tokens as different).

Attention: one layer's attention at the full-size Thinker's shape (32 query heads, 4 kv heads of
128) over contexts of 256 to 8,192 rows, keys and values drawn from a unit Gaussian in the model's
dtype, the KV once as it is and once through fp8: ||out_fp8 − out|| / ||out||, the torch path's
(gathered rows, SDPA) and, on a GPU, our kernel's over the fp8 pools against the torch path over
the unquantized ones. Random rows have no outlier channels, unlike a trained model's keys: the
per-(token, head) scale follows each row's largest value, so an outlier costs that row's others
precision. Every model here has random weights: the numbers catch a broken path and size the
rounding; a real checkpoint's quality needs its weights.
"""

import json
from pathlib import Path

import torch

from omni_local.api import OmniLocal
from omni_local.bench.common import bench_parser
from omni_local.bench.scenarios import SYSTEM
from omni_local.bench.weight_quality import ASKS, bench_settings
from omni_local.engine.memory.attention import gathered_attention
from omni_local.model.loader import resolve_device, resolve_dtype
from omni_local.model.quantized.formats import quantize
from omni_local.settings import Settings

HEADS, KV_HEADS, HEAD_DIM, BLOCK_TOKENS = 32, 4, 128, 16  # the full-size Thinker's attention
CONTEXTS = (256, 1024, 4096, 8192)


def replies(settings: Settings, kv_dtype: str, new_tokens: int) -> dict[str, list[int]]:
    """Each prompt's greedy reply token ids, with the KV stored as `kv_dtype` says."""
    with OmniLocal(settings.replace(kv_dtype=kv_dtype, prefix_cache=False, encoder_cache=False)) as app:
        return {name: app.session(system_prompt=SYSTEM).send(**_content(ask), max_new_tokens=new_tokens)
                .result().token_ids for name, ask in ASKS.items()}


def _content(ask: list) -> dict:
    """weight_quality's prompt (media, then the question) as `Session.send`'s arguments."""
    text = [part for part in ask if isinstance(part, str)]
    audio = [part for part in ask if hasattr(part, "dtype")]
    images = [part for part in ask if not isinstance(part, str) and not hasattr(part, "dtype")]
    return {"text": " ".join(text), "images": images, "audio": audio}


def agreement(reference: list[int], fp8: list[int]) -> dict:
    """The tokens before the first difference, and the share of `reference`'s positions fp8 matches."""
    first = next((i for i, (a, b) in enumerate(zip(reference, fp8)) if a != b), min(len(reference), len(fp8)))
    equal = sum(a == b for a, b in zip(reference, fp8))
    return {"tokens": len(reference), "first_difference": first, "equal_tokens": equal,
            "equal": equal / max(len(reference), 1)}


def attention_errors(device: torch.device, dtype: torch.dtype) -> list[dict]:
    """Per context: ||out_fp8 − out|| / ||out|| of one decode step of 4 sequences at the full-size shape."""
    rows = []
    for context in CONTEXTS:
        generator = torch.Generator(device).manual_seed(context)
        blocks = 4 * context // BLOCK_TOKENS
        pools = [torch.randn((blocks, KV_HEADS, BLOCK_TOKENS, HEAD_DIM), generator=generator, device=device).to(dtype)
                 for _ in range(2)]
        query = torch.randn((4, HEADS, 1, HEAD_DIM), generator=generator, device=device).to(dtype)
        tables = torch.arange(blocks, device=device).view(4, -1)
        query_rows = torch.full((4, 1), context - 1, device=device)
        exact = gathered_attention(query, *pools, tables, query_rows, HEAD_DIM ** -0.5).float()
        quantized = [quantize(pool, "fp8") for pool in pools]
        fp8 = ([q.values for q in quantized], ([q.scales for q in quantized]))
        row = {"context": context, "torch": _relative(gathered_attention(
            query, *fp8[0], tables, query_rows, HEAD_DIM ** -0.5, scales=tuple(fp8[1])), exact)}
        if device.type == "cuda":
            from omni_local.kernels.attention.paged import paged_attention  # imports triton

            row["kernel"] = _relative(paged_attention(query, *fp8[0], tables, query_rows, HEAD_DIM ** -0.5,
                                                      scales=tuple(fp8[1])), exact)
        rows.append(row)
    return rows


def _relative(out: torch.Tensor, exact: torch.Tensor) -> float:
    return ((out.float() - exact).norm() / exact.norm()).item()


def tables(result: dict) -> str:
    lines = [result["setup"]]
    if result["replies"]:
        lines += ["", "| prompt | reply tokens ('auto') | tokens before the first difference | positions equal |",
                  "|---|---|---|---|"]
        lines += [f"| {name} | {r['tokens']} | {r['first_difference']} | {r['equal']:.3f} |"
                  for name, r in result["replies"].items()]
        tokens = sum(r["tokens"] for r in result["replies"].values())
        equal = sum(r["equal_tokens"] for r in result["replies"].values())
        lines.append(f"| all prompts | {tokens} | | {equal / max(tokens, 1):.3f} |")
    if result["attention"]:
        lines += ["", "| context rows | torch path: ‖out_fp8 − out‖ / ‖out‖ | our kernel |", "|---|---|---|"]
        lines += [f"| {r['context']:,} | {r['torch']:.4f} | {r['kernel']:.4f} |" if "kernel" in r else
                  f"| {r['context']:,} | {r['torch']:.4f} | (on a GPU) |"
                  for r in result["attention"]]
    return "\n".join(lines)


def main() -> None:
    parser = bench_parser("python -m omni_local.bench.kv_quality", timed=False)
    parser.add_argument("--wide-demo", action="store_true", help="the demo at rows of 256 inputs, beside the demo")
    parser.add_argument("--new-tokens", type=int, default=32, help="each greedy reply's most tokens")
    parser.add_argument("--attention-only", action="store_true", help="only the full-size attention's error")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    settings = bench_settings(args)
    device = resolve_device(settings.device)
    dtype = resolve_dtype(settings.dtype, device)
    result = {"setup": f"{settings.model}; {device}, {dtype}; torch {torch.__version__}", "replies": {},
              "attention": []}
    if not args.attention_only:
        auto, fp8 = (replies(settings, kv, args.new_tokens) for kv in ("auto", "fp8"))
        result["replies"] = {name: agreement(auto[name], fp8[name]) for name in auto}
    with torch.inference_mode():
        result["attention"] = attention_errors(device, dtype)
    print(tables(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
