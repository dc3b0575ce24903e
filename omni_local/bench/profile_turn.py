"""Where a request's time to its first token (or first audio) goes: bench scenarios' timed turns
under torch.profiler, the engine's phases on its threads beside the device's kernels.

    python -m omni_local.bench.profile_turn --only "shared 2,084"              # demo model, CPU smoke run
    python -m omni_local.bench.profile_turn --random-weights CONFIG.json --only "video 10 s, first send" \\
        --only "shared 2,084" --only "spoken reply, first send"           # each in turn, one model load
    python -m omni_local.bench.profile_turn --random-weights CONFIG.json --only "first send beside"

A first send runs with every cache off, the rest with the caches the settings say, as the bench's
rows (two apps on the model loaded once). A run opens the scenario's chat as the bench does (its
earlier turns; for a `warm_cache` scenario, another chat's first look before; for a `beside` one,
another chat decoding meanwhile), waits --reading-seconds, then sends the timed turn and profiles
it until its first token (a spoken scenario's: its first audio). After a warm-up run, --runs runs
unprofiled give the time to first token the bench would show, then --runs profiled ones the
tables; each cell is a median over the profiled runs. --first-use profiles the first run alone,
with no warm-up: what a first turn after start-up pays (the bench's `--no-warm-up --runs 1`). With
--whole-reply the profiles run on to the reply's end: where a spoken reply's frames go once it
speaks, the real-time factor's share.

- The engine's phases (engine/phases.py): each one's summed time in the turn and how often it ran,
  up to the end of the first token's phase (spoken, the whole profile). "prepare prompt" holds
  "encode media", and "first token" a spoken reply's "begin speech". "build prompt" runs on the
  engine's prompt builder, the rest on its worker, whose time in no phase is its loop, waiting
  for work, or work not named.
- The device: kernels by category (profile_decode's), their summed time, and the device's busy
  time, the union of its kernels' intervals: the rest of the turn the device waited for the host.
  On the CPU there are no kernels: ATen ops on every thread, by self time, and no busy time.
- Beside a decoding chat: that chat's longest gap between two of the engine's reads of its tokens
  ("read decode step"), and what the engine did in it, for each profiled run.
- What compiled or was captured in each profiled run, from its send to its reply's end
  (compile_log.py): what a warm start-up should have paid, for --first-use.
- With --trace FOLDER, each scenario's last profiled run as a gzipped Chrome trace, every thread and
  kernel on one timeline (chrome://tracing, or ui.perfetto.dev; gzipped, as the lent GPU machine
  sends back only files of limited size: a cold 2,123-token prompt's 2.5 MB of JSON is 121 KB).
Scenarios of several chats at once, in turn or after a restart are the bench's alone.
"""

import argparse
import itertools
import re
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from omni_local.api import AudioChunk, Finished, OmniLocal, Reply, TextDelta
from omni_local.bench.beside import beside_a_decoding_chat
from omni_local.bench.compile_log import CompileLog, compile_log
from omni_local.bench.common import bench_parser, settings_and_model
from omni_local.bench.decode_steps import device_label
from omni_local.bench.profile_decode import CATEGORIES, DEVICE_WORK, category, is_work
from omni_local.bench.scenarios import Scenario, available, first_look, opened, question, send
from omni_local.engine.phases import COLLECT, FIRST_TOKEN, PHASES

Span = tuple[str, float, float]  # (name, start, end), µs on the profiler's clock


@dataclass(frozen=True)
class Profiled:
    """A profiled run: its torch.profiler recording, and what compiled or was captured meanwhile."""

    recorded: profile
    compiled: CompileLog


def profiled_turn(app: OmniLocal, scenario: Scenario, run: int, new_tokens: int, reading_s: float,
                  profiling: bool, whole_reply: bool = False) -> tuple[float | None, Profiled | None]:
    """One run of `scenario`'s timed turn: its time to first token (to first audio where it speaks), in
    seconds, and the profile from its send to then, or to the reply's end with `whole_reply`, with what
    compiled meanwhile (None unless `profiling`). A spoken reply that ended at its first token (random
    weights may say end-of-turn first) has no first audio: None."""
    if scenario.warm_cache:
        first_look(app, scenario, run, new_tokens)
    session = opened(app, scenario, run, 0, new_tokens, scenario.speak)
    time.sleep(reading_s)
    recorder = _profiler(app) if profiling else None

    def timed() -> Finished:
        if recorder is not None:
            recorder.start()
        reply = send(session, question(scenario, run), new_tokens, scenario.speak)
        _wait_for_first(reply, Finished if whole_reply else AudioChunk if scenario.speak else TextDelta)
        if recorder is not None:
            recorder.stop()
        return reply.result()

    with compile_log() as compiled:
        final = beside_a_decoding_chat(app, scenario.system, run, timed)[0] if scenario.beside else timed()
    profiled = Profiled(recorder, compiled) if recorder is not None else None
    if not scenario.speak:
        return final.timings.ttft_s, profiled
    return (final.speech.first_audio_s if final.speech is not None else None), profiled


def _profiler(app: OmniLocal) -> profile:
    """torch.profiler over every thread (the engine's worker and prompt builder are not the caller's),
    kernels too on a GPU."""
    cuda = app.backend.engine.runner.device.type == "cuda"
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    try:
        every_thread = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except TypeError:  # a torch without the option: kernels are still recorded, the engine's phases not
        every_thread = None
    return profile(activities=activities, experimental_config=every_thread)


def _wait_for_first(reply: Reply, kind: type) -> None:
    for event in reply:
        if isinstance(event, (kind, Finished)):
            return


def phase_spans(recorded: profile) -> list[Span]:
    return sorted(((e.name, e.time_range.start, e.time_range.end) for e in recorded.events() if e.name in PHASES),
                  key=lambda span: span[1])


def device_work(recorded: profile, cuda: bool) -> list[Span]:
    """Each kernel, copy and memset on the GPU; on the CPU, each ATen op from its start for its self
    time (its children's apart)."""
    if cuda:
        return [(e.name, e.time_range.start, e.time_range.end) for e in recorded.events()
                if is_work(e, DeviceType.CUDA, DEVICE_WORK)]
    return [(e.name, e.time_range.start, e.time_range.start + e.self_cpu_time_total) for e in recorded.events()
            if is_work(e, DeviceType.CPU, ("cpu_op",))]


def first_token_end(phases: list[Span]) -> float:
    """When the first token's phase ends; where the profile holds none, never (inf)."""
    return next((end for name, _, end in phases if name == FIRST_TOKEN), float("inf"))


def until_first_token(spans: list[Span], phases: list[Span]) -> list[Span]:
    """`spans` up to the end of the first token's phase, where the profile holds one: the profile runs
    until the reply's first text, which can come a few tokens later (a token of part of a character)."""
    return within(spans, float("-inf"), first_token_end(phases))


def totals(spans: list[Span], name_of: Callable[[str], str]) -> dict[str, tuple[int, float]]:
    """(count, summed ms) of `spans` by `name_of` their name."""
    count, ms = Counter(), defaultdict(float)
    for name, start, end in spans:
        count[name_of(name)] += 1
        ms[name_of(name)] += (end - start) / 1e3
    return {name: (count[name], ms[name]) for name in count}


def busy_ms(spans: list[Span]) -> float:
    """The length of the union of the spans' intervals (µs), in ms."""
    busy, reached = 0.0, float("-inf")
    for _, start, end in sorted(spans, key=lambda span: span[1]):
        if end > reached:
            busy += end - max(start, reached)
            reached = end
    return busy / 1e3


def within(spans: list[Span], start: float, end: float) -> list[Span]:
    """The parts of `spans` inside [start, end]."""
    return [(name, max(s, start), min(e, end)) for name, s, e in spans if s < end and e > start]


def longest_read_gap(phases: list[Span]) -> tuple[float, float] | None:
    """The longest interval between the ends of two consecutive reads of a decode step that begins
    before the first token's phase ends (the bench's gaps, beside.py, are those until the first
    token), or None where there is none."""
    until = first_token_end(phases)
    reads = [end for name, _, end in phases if name == COLLECT]
    gaps = [(earlier, later) for earlier, later in zip(reads, reads[1:]) if earlier <= until]
    return max(gaps, key=lambda pair: pair[1] - pair[0], default=None)


def median_cells(samples: list[dict[str, tuple[int, float]]], names: list[str]) -> list[tuple[str, float, float]]:
    """(name, count, ms) for each of `names` any sample holds, each the median over `samples`
    (a sample without it counts 0, 0)."""
    held = [name for name in names if any(name in s for s in samples)]
    return [(name, statistics.median(s.get(name, (0, 0.0))[0] for s in samples),
             statistics.median(s.get(name, (0, 0.0))[1] for s in samples)) for name in held]


def print_rows(title: str, what: str, rows: list[tuple[str, float, float]]) -> None:
    print(f"\n| {title} | {what} | ms |\n| --- | --- | --- |")
    for name, count, ms in rows:
        print(f"| {name} | {count:g} | {ms:.2f} |")


def print_gaps(recorded: list[profile], cuda: bool) -> None:
    """For each run, the decoding chat's longest gap between two token reads and what filled it."""
    print("\nThe decoding chat's longest gap between two token reads, and the engine's phases in it:")
    for run, one in enumerate(recorded):
        phases = phase_spans(one)
        gap = longest_read_gap(phases)
        if gap is None:
            print(f"- run {run}: fewer than two reads in the profile")
            continue
        inside = totals(within(phases, *gap), str)
        filled = ", ".join(f"{name.removeprefix('engine: ')} {n}x {ms:.2f} ms" for name, (n, ms) in inside.items())
        busy = f"; device busy {busy_ms(within(device_work(one, cuda), *gap)):.2f} ms" if cuda else ""
        print(f"- run {run}: {(gap[1] - gap[0]) / 1e3:.2f} ms: {filled}{busy}")


def profile_scenario(app: OmniLocal, scenario: Scenario, args: argparse.Namespace) -> None:
    """Profile `scenario`'s timed turn (after warm-ups) and print its tables."""
    cuda = app.backend.engine.runner.device.type == "cuda"
    questions = itertools.count()  # each run asks a new one, as the bench's

    def turns(count: int, profiling: bool) -> list[tuple[float, Profiled | None]]:
        """`count` runs that reached their first token or audio; a spoken one that did not is asked again."""
        done = []
        for _ in range(3 * count + 3):
            first, recorded = profiled_turn(app, scenario, next(questions), args.new_tokens, args.reading_seconds,
                                            profiling, args.whole_reply)
            if first is not None:
                done.append((first, recorded))
            if len(done) == count:
                return done
        raise SystemExit(f"'{scenario.name}': {3 * count + 3} replies, and fewer than {count} spoke")

    if args.first_use:  # what the first run pays that later ones do not: no warm-up
        profiled = turns(1, profiling=True)
        plain = [seconds * 1e3 for seconds, _ in profiled]
    else:
        turns(1, profiling=False)  # compiles, first uses
        turns(1, profiling=True)  # the profiler's own first start
        plain = [seconds * 1e3 for seconds, _ in turns(args.runs, profiling=False)]
        profiled = turns(args.runs, profiling=True)
    runner = app.backend.engine.runner
    first = "first audio" if scenario.speak else "first token"
    caches = "on" if app.settings.prefix_cache else "off"
    runs = "Its first run since start-up, profiled" if args.first_use else f"Medians of {args.runs} profiled runs"
    print(f"\n## '{scenario.name}': where the time to {first} goes\n\n{runs}; "
          f"{device_label(runner)}, caches {caches}, MoE backend "
          f"{runner.regions.moe.name}. Time to {first}: {statistics.median(plain):.2f} ms unprofiled, "
          f"{statistics.median(seconds * 1e3 for seconds, _ in profiled):.2f} ms profiled.")
    recorded = [p.recorded for _, p in profiled]
    print("\nCompiled or captured from the send to the reply's end:")
    for run, (_, p) in enumerate(profiled):
        print(f"- run {run}: {p.compiled.summary()}")
        print("".join(f"  - {kernel}\n" for kernel in p.compiled.triton_kernels), end="")
    phases = [phase_spans(r) for r in recorded]
    work = [device_work(r, cuda) for r in recorded]
    if args.whole_reply:
        print("\nProfiled from the send to the reply's end: every token and audio frame.")
    elif not scenario.speak:
        work = [until_first_token(w, p) for w, p in zip(work, phases)]
        phases = [until_first_token(p, p) for p in phases]
    print_rows("engine phase", "calls", median_cells([totals(p, str) for p in phases], PHASES))
    print_rows("device work", "kernels" if cuda else "ATen ops, self CPU time",
               median_cells([totals(w, category) for w in work], CATEGORIES))
    if cuda:
        print(f"\nDevice busy (the union of its kernels' intervals): {statistics.median(map(busy_ms, work)):.2f} ms")
    if scenario.beside:
        print_gaps(recorded, cuda)
    if args.trace is not None:
        args.trace.mkdir(parents=True, exist_ok=True)
        path = args.trace / f"{re.sub(r'[^a-z0-9]+', '-', scenario.name.lower()).strip('-')}.json.gz"
        recorded[-1].export_chrome_trace(str(path))
        print(f"\nThe last profiled run's trace (chrome://tracing, Perfetto): {path}")


def main() -> None:
    parser = bench_parser("python -m omni_local.bench.profile_turn")
    parser.add_argument("--only", action="append", required=True, metavar="TEXT",
                        help="profile the scenario whose name holds TEXT (the first, in the bench's order); "
                             "repeatable, each in turn on one app")
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument("--reading-seconds", type=float, default=0.5,
                        help="pause before each timed turn, as the bench's")
    parser.add_argument("--whole-reply", action="store_true",
                        help="profile each timed turn to its reply's end, not to its first token or audio "
                             "(where a spoken reply's frames go once it speaks)")
    parser.add_argument("--first-use", action="store_true",
                        help="profile each scenario's first run instead, with no warm-up before it (the first "
                             "--only: its app's first such request since start-up)")
    parser.add_argument("--trace", type=Path, metavar="FOLDER",
                        help="write each scenario's last profiled run there as a gzipped Chrome trace")
    args = parser.parse_args()
    settings, loaded = settings_and_model(args)
    every_cache_off = settings.replace(prefix_cache=False, encoder_cache=False)
    with OmniLocal(settings, loaded=loaded) as cached, OmniLocal(every_cache_off, loaded) as cold:
        served, chosen = available(cached), []
        for text in args.only:
            scenario = next((s for s in served if text in s.name), None)
            if scenario is None:
                parser.error(f"no scenario's name holds {text!r}: " + "; ".join(s.name for s in served))
            if scenario.concurrency > 1 or scenario.in_turn or scenario.restart:
                parser.error(f"'{scenario.name}' is more than one request's path: the bench times it")
            chosen.append(scenario)
        for scenario in chosen:
            profile_scenario(cold if scenario.first_send else cached, scenario, args)


if __name__ == "__main__":
    main()
