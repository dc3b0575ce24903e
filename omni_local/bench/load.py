"""Many users at once: N clients asking for a fixed time, through the Python API and through the
HTTP server with the `openai` SDK; a row of throughput, latency percentiles and memory for each.

    python -m omni_local.bench.load --clients 1 4 --seconds 5                     # demo model: a smoke run
    python -m omni_local.bench.load --random-weights CONFIG.json --speech true    # full size (GPU)

Each client is a user who asks a question, reads the reply as it streams, and asks the next once it
has ended (a closed loop), until --seconds have passed; the row's wall time runs until the last
reply ends. Every request is a new chat's first turn (the same system prompt, computed once and
then taken from the prefix cache), its question its own: --question-tokens words drawn for that
client and request (load_clients.py), with its own picture or clip under --media. Identical
questions would route to the same experts, a load no group of users makes. A request's TTFT runs
from before `send`, so it holds reading its media: through HTTP, encoding them for the body too
(a noise picture of 480x640 as PNG: tens of ms on a CPU core), as a client's upload would.

`--through api`: the clients are threads of this process, each with sessions of one `OmniLocal`
(the server's packages need not be installed).
`--through http`: the same engine served over HTTP (the app `python -m omni_local serve` serves,
on a free port in this process); the clients are the remote backend's, which stream with the
`openai` SDK, in a process of their own. A spoken reply is asked for as `modalities: ["text",
"audio"]`. The server may hold --api-max-requests at once; the bench raises it to the most clients
asked for, so no client is turned away (beyond the engine's --max-running-requests, requests queue).

Before each row, unless --no-warm-up, every client sends one untimed request at once: what the
row's batch sizes compile or capture first is not in its figures.

The figures are over the row's complete replies, as their clients saw them: requests/s and
generated tokens/s over the wall time; time to first text (TTFT); the gaps between one piece of text
and the next (ITL); time to first audio, and the real-time factor (time to the last audio over the
audio's duration); the engine's own queue wait (submit until it took the request); the GPU memory
the process peaked at during the row. A reply is complete when the engine ended it (end of turn or
--new-tokens), with all the text and audio it reported streamed; any other is counted apart, and
the first failure's message is printed. The table goes to stdout, JSON to --json.
"""

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path

import torch

import omni_local
from omni_local.api import OmniLocal
from omni_local.bench.common import SERVING_MODULES, bench_parser, require_modules, served, settings_and_model
from omni_local.bench.load_clients import MEDIA, LoadSpec, Sample, one_token_words, run_row
from omni_local.bench.scenarios import SYSTEM

CLIENTS = [1, 4, 16, 64]
COLUMNS = ["through", "clients", "replies", "requests", "incomplete", "requests/s", "tokens/s", "TTFT p50 (ms)",
           "TTFT p95 (ms)", "ITL p50 (ms)", "ITL p95 (ms)", "first audio p50 (ms)", "first audio p95 (ms)",
           "RTF p50", "RTF p95", "queue wait p95 (ms)", "GPU memory (GiB)"]


def percentile(values: list[float], share: float) -> float:
    """The nearest-rank percentile (`share` 0.5: the median): the smallest value that at least that
    share of the values are at most; NaN for no values."""
    known = sorted(v for v in values if v is not None and not math.isnan(v))
    return known[max(0, math.ceil(share * len(known)) - 1)] if known else math.nan


def row_figures(samples: list[Sample], wall_s: float) -> dict[str, float]:
    """The row's figures over its complete replies (times in ms)."""
    done = [s for s in samples if s.complete]
    ttft, gaps = [s.ttft_s for s in done], [gap for s in done for gap in s.gaps_s]
    first_audio, rtf = [s.first_audio_s for s in done], [s.rtf for s in done]
    return {
        "requests": len(done), "incomplete": len(samples) - len(done), "requests_per_s": len(done) / wall_s,
        "tokens_per_s": sum(s.generated for s in done) / wall_s,
        "ttft_p50_ms": percentile(ttft, 0.5) * 1e3, "ttft_p95_ms": percentile(ttft, 0.95) * 1e3,
        "itl_p50_ms": percentile(gaps, 0.5) * 1e3, "itl_p95_ms": percentile(gaps, 0.95) * 1e3,
        "first_audio_p50_ms": percentile(first_audio, 0.5) * 1e3,
        "first_audio_p95_ms": percentile(first_audio, 0.95) * 1e3,
        "rtf_p50": percentile(rtf, 0.5), "rtf_p95": percentile(rtf, 0.95),
        "queue_p95_ms": percentile([s.queue_wait_s for s in done], 0.95) * 1e3,
    }


def http_row(url: str, spec: LoadSpec, warm_up: bool) -> tuple[list[Sample], float]:
    """The row's clients in a process of their own (load_clients.py), on the server at `url`."""
    asked = json.dumps({"spec": dataclasses.asdict(spec), "warm_up": warm_up})
    source = str(Path(omni_local.__file__).resolve().parent.parent)  # this checkout's omni_local, as here
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [source, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "omni_local.bench.load_clients", url], input=asked,
                          stdout=subprocess.PIPE, text=True, env=env, check=True)
    answer = json.loads(done.stdout)
    return [Sample(**s) for s in answer["samples"]], answer["wall_s"]


def measured_row(app: OmniLocal, url: str | None, spec: LoadSpec, warm_up: bool) -> dict:
    """One row: through the API where `url` is None, else through the server at `url`."""
    gpu = app.backend.loaded.device.type == "cuda"
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    samples, wall_s = run_row(app, spec, warm_up) if url is None else http_row(url, spec, warm_up)
    failures = [s.failure for s in samples if s.failure]
    if failures:
        print(f"{len(failures)} of {len(samples)} requests failed; the first: {failures[0]}", file=sys.stderr)
    memory = torch.cuda.max_memory_allocated() / 2**30 if gpu else math.nan
    return {"through": "http" if url else "api", "clients": spec.clients, "replies": "spoken" if spec.speak else "text",
            **row_figures(samples, wall_s), "gpu_memory_gib": memory}


def table_row(row: dict) -> str:
    figures = [row[key] for key in ("requests", "incomplete", "requests_per_s", "tokens_per_s", "ttft_p50_ms",
                                    "ttft_p95_ms", "itl_p50_ms", "itl_p95_ms", "first_audio_p50_ms",
                                    "first_audio_p95_ms", "rtf_p50", "rtf_p95", "queue_p95_ms", "gpu_memory_gib")]
    cells = [row["through"], str(row["clients"]), row["replies"], *(_cell(v) for v in figures)]
    return "| " + " | ".join(cells) + " |"


def _cell(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    return "-" if math.isnan(value) else f"{value:.2f}" if value < 10 else f"{value:.1f}"


def parser() -> argparse.ArgumentParser:
    parser = bench_parser("python -m omni_local.bench.load", timed=False)
    parser.add_argument("--clients", type=int, nargs="+", default=CLIENTS, help="clients at once (one row each)")
    parser.add_argument("--seconds", type=float, default=30.0, help="how long each row's clients keep asking")
    parser.add_argument("--through", choices=["api", "http", "both"], default="both")
    parser.add_argument("--replies", nargs="+", choices=["text", "spoken"],
                        help="text replies, spoken ones, or both (the default: both with --speech true, else text)")
    parser.add_argument("--new-tokens", type=int, default=32, help="the longest reply, in tokens")
    parser.add_argument("--question-tokens", type=int, default=100, help="each question's length, in tokens")
    parser.add_argument("--media", choices=MEDIA, default="none", help="each question's own picture or clip")
    parser.add_argument("--no-warm-up", action="store_true", help="time each row's first requests too")
    parser.add_argument("--json", type=Path, help="write the results here")
    return parser


def main() -> None:
    args = parser().parse_args()
    if args.through != "api":
        require_modules(SERVING_MODULES, "--through http")
    settings, loaded = settings_and_model(args)
    settings = settings.replace(api_max_requests=max(settings.api_max_requests, *args.clients))
    replies = args.replies or (["text", "spoken"] if settings.speech else ["text"])
    if "spoken" in replies and not settings.speech:
        sys.exit("spoken replies need the Talker: add --speech true")
    throughs = ["api", "http"] if args.through == "both" else [args.through]
    words = one_token_words(loaded.processor.tokenizer)
    environment = {"model": f"{args.random_weights} (random weights)" if args.random_weights else "demo",
                   "device": str(loaded.device), "dtype": str(loaded.dtype).removeprefix("torch."),
                   "seconds": args.seconds, "new_tokens": args.new_tokens, "question_tokens": args.question_tokens,
                   "media": args.media, "max_running_requests": settings.max_running_requests,
                   "warm-up": not args.no_warm_up}
    print(", ".join(f"{k}: {v}" for k, v in environment.items()) + "\n")
    print("| " + " | ".join(COLUMNS) + " |\n|" + " --- |" * len(COLUMNS), flush=True)
    rows = []
    with OmniLocal(settings, loaded=loaded) as app, served(app) if "http" in throughs else nullcontext() as url:
        for through in throughs:
            for spoken in (kind == "spoken" for kind in replies):
                for clients in args.clients:
                    spec = LoadSpec(len(rows), clients, args.seconds, SYSTEM, words, args.question_tokens,
                                    args.new_tokens, spoken, args.media)
                    rows.append(measured_row(app, url if through == "http" else None, spec, not args.no_warm_up))
                    print(table_row(rows[-1]), flush=True)  # as it is measured: a run cut short keeps its rows
    if args.json:
        args.json.write_text(json.dumps({"environment": environment, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
