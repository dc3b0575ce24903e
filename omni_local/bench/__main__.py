"""Side-by-side timings: the engine and plain transformers on the same prompts; a table of medians.

    python -m omni_local.bench                                   # demo model: a smoke run
    python -m omni_local.bench --random-weights CONFIG.json      # full size, random weights (GPU)

Prompts follow ../shared/BENCHMARK_ANCHORS.md: a system prompt, one 480x640 image, a question.
Each row is the median of --runs after one warm-up run. The table goes to stdout, JSON to --json.
"""

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import transformers
from PIL import Image

from omni_local.api import OmniLocal
from omni_local.bench.random_weights import load_random_weights
from omni_local.model.loader import quiet_library_logs
from omni_local.prompts import Message, build_prompt
from omni_local.settings import add_settings_arguments, settings_from_arguments

SYSTEM = (
    "You are a helpful assistant who looks carefully at pictures and listens to sounds, then answers "
    "the question in a few clear words without guessing."
)
QUESTION = "What is in this picture, and what colour is the house?"


def scenarios() -> dict[str, list[Message]]:
    pixels = np.random.default_rng(0).integers(0, 256, (480, 640, 3), dtype=np.uint8)
    return {
        "text": [Message("system", [SYSTEM]), Message("user", [QUESTION])],
        "image 480x640": [Message("system", [SYSTEM]), Message("user", [Image.fromarray(pixels), QUESTION])],
    }


def median_of(runs: int, measure: Callable[[], dict[str, float]]) -> dict[str, float]:
    measure()  # warm-up
    samples = [measure() for _ in range(runs)]
    return {key: statistics.median(s[key] for s in samples) for key in samples[0]}


def engine_run(app: OmniLocal, messages: list[Message], new_tokens: int) -> dict[str, float]:
    session = app.session()
    session.history = messages[:-1]
    final = session.send(**_as_send(messages[-1]), max_new_tokens=new_tokens).result()
    itl = 1 / final.timings.decode_tokens_per_s if final.timings.decode_tokens_per_s else float("nan")
    return {"ttft_ms": final.timings.ttft_s * 1e3, "itl_ms": itl * 1e3, "generated": final.tokens.generated}


def transformers_run(app: OmniLocal, messages: list[Message], new_tokens: int) -> dict[str, float]:
    """`thinker.generate` on the same inputs: the first token alone, then a whole reply."""
    prompt = build_prompt(messages, app.loaded.processor)
    inputs = {k: v.to(app.loaded.device) for k, v in prompt.model_inputs(app.loaded.processor).items()}
    thinker = app.loaded.model.thinker

    def timed(tokens: int) -> float:
        _sync()
        start = time.perf_counter()
        with torch.inference_mode():
            thinker.generate(**inputs, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        _sync()
        return time.perf_counter() - start

    first, whole = timed(1), timed(new_tokens)
    return {"ttft_ms": first * 1e3, "itl_ms": (whole - first) / (new_tokens - 1) * 1e3, "generated": new_tokens}


def _as_send(message: Message) -> dict:
    return {"text": message.text, "images": message.images(), "audio": message.audios()}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m omni_local.bench")
    parser.add_argument("--random-weights", type=Path, help="a full-size config.json, built with random weights")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--json", type=Path, help="write the results here")
    add_settings_arguments(parser)
    args = parser.parse_args()
    quiet_library_logs()
    settings = settings_from_arguments(args)
    loaded = load_random_weights(args.random_weights, settings) if args.random_weights else None
    rows = []
    with OmniLocal(settings, loaded=loaded) as app:
        for name, messages in scenarios().items():
            tokens = build_prompt(messages, app.loaded.processor).num_tokens
            for system, run in (("omni_local", engine_run), ("transformers", transformers_run)):
                result = median_of(args.runs, lambda: run(app, messages, args.new_tokens))
                rows.append({"scenario": name, "prompt_tokens": tokens, "system": system, **result})
        environment = _environment(app, args)
    print(_table(rows, environment))
    if args.json:
        args.json.write_text(json.dumps({"environment": environment, "rows": rows}, indent=2))


def _environment(app: OmniLocal, args: argparse.Namespace) -> dict[str, str]:
    device = app.loaded.device
    return {
        "model": str(args.random_weights or "demo") + (" (random weights)" if args.random_weights else ""),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "dtype": str(app.loaded.dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "attention": app.settings.attn_implementation,
        "runs": str(args.runs),
        "new_tokens": str(args.new_tokens),
    }


def _table(rows: list[dict], environment: dict[str, str]) -> str:
    lines = [", ".join(f"{k}: {v}" for k, v in environment.items()), ""]
    lines += ["| scenario | prompt tokens | system | TTFT (ms) | ITL (ms) |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['scenario']} | {r['prompt_tokens']} | {r['system']} | {r['ttft_ms']:.1f} | {r['itl_ms']:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
