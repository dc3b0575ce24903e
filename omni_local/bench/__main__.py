"""Side-by-side timings: the engine and plain transformers on the same prompts; a table of medians.

    python -m omni_local.bench                                   # demo model: a smoke run
    python -m omni_local.bench --random-weights CONFIG.json      # full size, random weights (GPU)

The scenarios are in scenarios.py, the transformers baseline in transformers_baseline.py. Each row
is the median of --runs after one warm-up run; each run asks a new question, so the cache rows
reuse only what a real user's next request would. "cache off" means every cache off (prefix and
encoder), so a first send really runs its encoder. The table goes to stdout, JSON to --json.

Each row's runs follow a warm-up run, which pays what a first use costs (compiles, kernel choices);
`--no-warm-up --runs 1` times that first use instead: the first row of a process, its first such
request since start-up (a voice turn 2 right after start-up, say).

A timed turn is sent --reading-seconds (0.5) after the turns before it finished, as a person
reads a reply before the next question. The engine uses such idle time to keep blocks free ahead
of need (moving the least recently used chats to host memory, a copy of their whole KV); a request
sent back to back with the one before would wait for that move.

Concurrent rows (c8, c16): that many sessions send their timed turn at once, each its own question
(scenarios.py), as that many users would (identical chats would compute identical tokens, routed to
the same experts: a figure about half what 16 users see); the row is the median
over the requests of each one's TTFT and ITL (the engine's own timings). Give the engine a seat
per session (--max-running-requests, 16 by default) and room for their KV (--gpu-cache-bytes),
or the rows include waiting for them. transformers runs those
requests one after another ("transformers, sequential"): each one's TTFT includes the whole replies
before it, as with a server that does not batch.

"in turn" (32 chats of about 1,000 tokens): the sessions are opened once (each sends its long
turn), then each run sends a turn to each of them, one after another, as a person taking up one
chat after another; only with the cache on, where it shows whether their KV stays on the device.
Every row's "queue wait p95" is the 95th percentile over its requests of their wait for admission
(for a seat, and for room for their KV, other chats' moves to host memory included; building the
prompt is not waiting), the median over runs.

"beside a decoding chat": another chat is decoding a long reply when the timed turn is sent; the
row adds that chat's longest gap between two of its tokens until the timed turn's first token
(bench/beside.py). omni_local only, cache off: transformers serves one request at a time, so there
the other chat would wait for the whole prefill. The 470-token prompt's first send is one prefill
chunk alone (with the template and question, under the default 512): that gap should stay within
its TTFT and one decode step.

"after restart": the first app asks about the image, then a new OmniLocal starts on the same
settings and cache folder and is asked about it again. Its start-up (from `OmniLocal(...)` to ready:
KV allocation, warm-up, encoder cache opening) is its own column, apart from the TTFT; the model
stays in memory, so its load is not timed (random weights cannot be loaded again). transformers
has nothing to start there: its row is that image's first send on the model in memory.

With `--speech true` the spoken rows run too (the Talker samples, as by default; the reply's
length is capped by --max-speech-seconds): time to first audio and real-time factor, against
transformers' `generate(return_audio=True)`, which plays nothing until it is done.
"""

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import torch
import transformers

from omni_local.api import Finished, OmniLocal, Reply, Session
from omni_local.bench.beside import beside_a_decoding_chat
from omni_local.bench.common import bench_parser, medians, settings_and_model, synced_now
from omni_local.bench.scenarios import Scenario, available, first_look, opened, question, send
from omni_local.bench.transformers_baseline import transformers_run
from omni_local.start_up_steps import show_start_up_steps

# A row's label, the app it runs on, and how one run is timed (engine_run or transformers_run).
System = tuple[str, OmniLocal, Callable[[OmniLocal, Scenario, int, int], dict[str, float]]]
_IN_TURN_CHATS: dict[tuple[int, str], list[Session]] = {}  # (app, scenario) -> its chats taken up in turn


def median_of(runs: int, measure: Callable[[int], dict[str, float]], warm_up: bool = True) -> dict[str, float]:
    if warm_up:
        measure(-1)
    return medians([measure(run) for run in range(runs)])


def engine_run(app: OmniLocal, scenario: Scenario, run: int, new_tokens: int, reading_s: float) -> dict[str, float]:
    """One run of `scenario` through omni_local: another session sends it first (`warm_cache`), then
    the timed turn goes to `app`, or to a new app on the same settings (`restart`)."""
    if scenario.warm_cache:
        first_look(app, scenario, run, new_tokens)
    if scenario.beside:
        session = opened(app, scenario, run, 0, new_tokens, scenario.speak)
        time.sleep(reading_s)
        final, gap_s = beside_a_decoding_chat(app, scenario.system, run,
                                              lambda: send(session, question(scenario, run), new_tokens,
                                                           scenario.speak).result())
        return _figures(final) | {"other_gap_ms": gap_s * 1e3}
    if scenario.in_turn:
        return _in_turn(app, scenario, run, new_tokens)
    if not scenario.restart:
        return _timed_turn(app, scenario, run, new_tokens, reading_s)
    start = synced_now()
    with OmniLocal(app.settings, loaded=app.backend.loaded) as restarted:
        start_up_s = synced_now() - start
        return _timed_turn(restarted, scenario, run, new_tokens, reading_s) | {"start_up_ms": start_up_s * 1e3}


def _timed_turn(app: OmniLocal, scenario: Scenario, run: int, new_tokens: int, reading_s: float) -> dict[str, float]:
    """The median over `scenario.concurrency` sessions that send their timed turn at the same time."""
    sessions = [opened(app, scenario, run, chat, new_tokens, scenario.speak) for chat in range(scenario.concurrency)]
    time.sleep(reading_s)
    replies = [send(session, question(scenario, run, chat), new_tokens, scenario.speak)
               for chat, session in enumerate(sessions)]
    # Every request is submitted before any is read; each reply's stream is read on its own thread,
    # as concurrent clients would. The times are the engine's own (Finished.timings).
    with ThreadPoolExecutor(len(replies)) as pool:
        return _over_requests(list(pool.map(Reply.result, replies)))


def _in_turn(app: OmniLocal, scenario: Scenario, run: int, new_tokens: int) -> dict[str, float]:
    """A turn of each of `scenario.in_turn` sessions, one after another, each once the one before has
    finished: chats a person takes up in turn. The same sessions every run (opened by the warm-up run,
    each with its earlier turns), so the chats on the device are these and no others."""
    key = (id(app), scenario.name)
    if key not in _IN_TURN_CHATS:
        _IN_TURN_CHATS[key] = [opened(app, scenario, run, chat, new_tokens, scenario.speak)
                               for chat in range(scenario.in_turn)]
    sessions = _IN_TURN_CHATS[key]
    return _over_requests([send(s, question(scenario, run, chat), new_tokens, scenario.speak).result()
                           for chat, s in enumerate(sessions)])


def _over_requests(finals: list[Finished]) -> dict[str, float]:
    """The medians of the requests' figures, and the 95th percentile of their waits for admission."""
    waits = sorted(final.timings.queue_wait_s for final in finals)
    return medians([_figures(final) for final in finals]) | {"queue_p95_ms": waits[round(0.95 * (len(waits) - 1))] * 1e3}


def _figures(final: Finished) -> dict[str, float]:
    itl = 1 / final.timings.decode_tokens_per_s if final.timings.decode_tokens_per_s else float("nan")
    n = final.tokens
    result = {"ttft_ms": final.timings.ttft_s * 1e3, "itl_ms": itl * 1e3, "prompt": n.prompt, "computed": n.computed,
              "media_encoded": final.media.encoded}
    if final.speech is not None:
        speech = final.speech
        result |= {"first_audio_ms": speech.first_audio_s * 1e3, "rtf": speech.real_time_factor,
                   "audio_s": speech.audio_s, "talker_prompt": speech.talker_prompt,
                   "talker_reused": speech.talker_reused}
    return result


def main() -> None:
    parser = bench_parser("python -m omni_local.bench")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--reading-seconds", type=float, default=0.5,
                        help="pause before each timed turn, as a person reading the reply before")
    parser.add_argument("--no-warm-up", action="store_true",
                        help="time each row's first run too: with --runs 1, the first such request since start-up")
    parser.add_argument("--only", action="append", default=[], metavar="TEXT",
                        help="run only the scenarios whose name holds TEXT (repeatable)")
    parser.add_argument("--exact", action="store_true", help="--only names whole scenario names")
    args = parser.parse_args()
    settings, loaded = settings_and_model(args)
    show_start_up_steps()
    every_cache_off = settings.replace(prefix_cache=False, encoder_cache=False)
    with OmniLocal(settings, loaded=loaded) as cached, OmniLocal(every_cache_off, loaded) as cold:
        engine = partial(engine_run, reading_s=args.reading_seconds)
        systems = (("omni_local, cache on", cached, engine), ("omni_local, cache off", cold, engine),
                   ("transformers", cold, transformers_run))
        chosen = chosen_scenarios(available(cached), args.only, args.exact)
        _warn_if_few_seats(cached, chosen)
        environment = _environment(cached, args)
        print(_table_head(environment), flush=True)
        rows = []
        for row in (row for scenario in chosen for row in _rows(scenario, systems, args)):
            print(_table_row(row), flush=True)  # as it is measured: a run cut short keeps what it measured
            rows.append(row)
    if args.json:
        args.json.write_text(json.dumps({"environment": environment, "rows": rows}, indent=2))


def chosen_scenarios(scenarios: list[Scenario], only: list[str], exact: bool) -> list[Scenario]:
    """The scenarios `only` names (all where it names none): those whose names hold one of its texts,
    or with `exact`, equal one."""
    return [s for s in scenarios if not only or any(text == s.name if exact else text in s.name for text in only)]


def _rows(scenario: Scenario, systems: tuple[System, ...], args: argparse.Namespace) -> Iterator[dict]:
    for system, app, run in systems:
        if scenario.first_send and system.endswith("cache on"):
            continue  # a first send has nothing to reuse: the cache-off row is the same
        if scenario.beside and run is transformers_run:
            continue  # one request at a time: nothing decodes beside its prefill
        if scenario.in_turn and system != "omni_local, cache on":
            continue  # chats taken up in turn show how their KV is kept: nothing to show without a cache
        if run is transformers_run and scenario.concurrency > 1:
            system += ", sequential"
        result = median_of(args.runs, lambda i: run(app, scenario, i, args.new_tokens), warm_up=not args.no_warm_up)
        yield {"scenario": scenario.name, "system": system, **result}


def _warn_if_few_seats(app: OmniLocal, chosen: list[Scenario]) -> None:
    most, seats = max((s.concurrency for s in chosen), default=1), app.backend.engine.seats.count
    if most > seats:
        print(f"note: {seats} requests run at once for {most} concurrent chats, so some wait for a seat "
              "(raise --max-running-requests)", file=sys.stderr)


def _environment(app: OmniLocal, args: argparse.Namespace) -> dict[str, str]:
    device = app.backend.loaded.device
    return {
        "model": str(args.random_weights or "demo") + (" (random weights)" if args.random_weights else ""),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "dtype": str(app.backend.loaded.dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "attention": app.settings.attn_implementation,
        "attention backend": "triton" if app.backend.engine.runner.attention.decode else "torch",
        "MoE backend": app.backend.engine.runner.regions.moe.name,
        "deterministic": str(app.settings.deterministic).lower(),
        "KV": f"{app.settings.gpu_cache_bytes / 2**30:g} GiB in blocks of {app.settings.kv_block_tokens}",
        "runs": str(args.runs) + ("" if not args.no_warm_up else ", no warm-up run"),
        "new_tokens": str(args.new_tokens),
    }


def _table_head(environment: dict[str, str]) -> str:
    columns = ["scenario", "prompt tokens", "system", "computed", "TTFT (ms)", "ITL (ms)", "start-up (ms)",
               "first audio (ms)", "RTF", "audio (s)", "other chat's longest gap (ms)", "queue wait p95 (ms)"]
    lines = [", ".join(f"{k}: {v}" for k, v in environment.items()), ""]
    return "\n".join([*lines, "| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)])


def _table_row(r: dict) -> str:
    start_up = f"{r['start_up_ms']:.1f}" if "start_up_ms" in r else "–"
    speech = f"{r['first_audio_ms']:.1f} | {r['rtf']:.2f} | {r['audio_s']:.2f}" if "rtf" in r else "– | – | –"
    gap = f"{r['other_gap_ms']:.1f}" if "other_gap_ms" in r else "–"
    queue = f"{r['queue_p95_ms']:.1f}" if "queue_p95_ms" in r else "–"
    return (f"| {r['scenario']} | {r['prompt']:.0f} | {r['system']} | {r['computed']:.0f} | "
            f"{r['ttft_ms']:.1f} | {r['itl_ms']:.2f} | {start_up} | {speech} | {gap} | {queue} |")

if __name__ == "__main__":
    main()
