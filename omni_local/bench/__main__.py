"""Side-by-side timings: the engine and plain transformers on the same prompts; a table of medians.

    python -m omni_local.bench                                   # demo model: a smoke run
    python -m omni_local.bench --random-weights CONFIG.json      # full size, random weights (GPU)

Prompts follow ../shared/BENCHMARK_ANCHORS.md: a system prompt, one 480x640 image, a question.
Each row is the median of --runs after one warm-up run; each run asks a new question, so the cache
rows reuse only what a real user's next request would. "cache off" means every cache off (prefix
and encoder), so a first send really runs its encoder. The table goes to stdout, JSON to --json.

With `--speech true` the spoken rows run too (the Talker samples, as by default; the reply's
length is capped by --max-speech-seconds): time to first audio and real-time factor, against
transformers' `generate(return_audio=True)`, which plays nothing until it is done.
"""

import argparse
import json
import platform
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import transformers
from PIL import Image

from omni_local.api import Finished, OmniLocal
from omni_local.bench.common import bench_parser, elapsed_s, settings_and_model
from omni_local.engine.vocoder import SAMPLE_RATE
from omni_local.media.video import Video
from omni_local.model.workarounds import video_supported
from omni_local.prompts import Message, build_prompt

SYSTEM = (
    "You are a helpful assistant who looks carefully at pictures and listens to sounds, then answers "
    "the question in a few clear words without guessing."
)
QUESTION = "What is in this picture, and what colour is the house?"
VIDEO_QUESTION = "What happens in this video, and what do you hear?"
# Spoken rows ask something else, so they never reuse a text row's conversation.
SPOKEN_QUESTION = "Tell me in two sentences what you can do for me today."


@dataclass(frozen=True)
class Scenario:
    """A conversation whose last user turn is timed; `earlier` turns are sent first, untimed, in the
    same session (so with the cache on, their KV is there), with a fresh question text each run."""

    name: str
    system: str
    earlier: list[Message]  # user turns sent before, in the same session
    last: Message
    warm_cache: bool = False  # another session sends the same conversation first
    speak: bool = False  # every turn is a spoken reply


def scenarios() -> list[Scenario]:
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (480, 640, 3), dtype=np.uint8))
    ask = Message("user", [QUESTION])
    return [
        Scenario("text, first send", SYSTEM, [], ask),
        Scenario("image 480x640, first send", SYSTEM, [], Message("user", [image, QUESTION])),
        Scenario("same image 480x640, new question", SYSTEM, [], Message("user", [image, QUESTION]), warm_cache=True),
        Scenario("text chat turn 2", SYSTEM, [Message("user", ["Hello! Who are you?"])], ask),
    ]


def video_scenarios() -> list[Scenario]:
    """A 10 s clip as it is read (2 frames a second, 360x640) with its sound track."""
    rng = np.random.default_rng(1)
    video = Video(rng.integers(0, 256, (20, 360, 640, 3), dtype=np.uint8), 2.0,
                  (rng.standard_normal(160_000) * 0.1).astype(np.float32))
    ask = Message("user", [video, VIDEO_QUESTION])
    return [
        Scenario("video 10 s, first send", SYSTEM, [], ask),
        Scenario("same video 10 s, new question", SYSTEM, [], ask, warm_cache=True),
    ]


def spoken_scenarios() -> list[Scenario]:
    ask = Message("user", [SPOKEN_QUESTION])
    return [
        Scenario("spoken reply, first send", SYSTEM, [], ask, speak=True),
        Scenario("voice chat turn 2", SYSTEM, [Message("user", ["Hello! Who are you?"])], ask, speak=True),
    ]


def median_of(runs: int, measure: Callable[[int], dict[str, float]]) -> dict[str, float]:
    measure(-1)  # warm-up
    samples = [measure(run) for run in range(runs)]
    return {key: statistics.median(s[key] for s in samples) for key in samples[0]}


def _question(scenario: Scenario, run: int) -> Message:
    """The timed turn, its text made new each run so no run is answered from an earlier one's cache."""
    return Message("user", [p if not isinstance(p, str) else f"Take {run}: {p}" for p in scenario.last.parts])


def engine_run(app: OmniLocal, scenario: Scenario, run: int, new_tokens: int) -> dict[str, float]:
    if scenario.warm_cache:
        _converse(app, scenario, Message("user", [*scenario.last.parts[:-1], f"First look {run}."]), new_tokens)
    final = _converse(app, scenario, _question(scenario, run), new_tokens)
    itl = 1 / final.timings.decode_tokens_per_s if final.timings.decode_tokens_per_s else float("nan")
    n = final.tokens
    result = {"ttft_ms": final.timings.ttft_s * 1e3, "itl_ms": itl * 1e3, "prompt": n.prompt, "computed": n.computed}
    if final.speech is not None:
        speech = final.speech
        result |= {"first_audio_ms": speech.first_audio_s * 1e3, "rtf": speech.real_time_factor,
                   "audio_s": speech.audio_s, "talker_prompt": speech.talker_prompt,
                   "talker_reused": speech.talker_reused}
    return result


def _converse(app: OmniLocal, scenario: Scenario, last: Message, new_tokens: int) -> Finished:
    session = app.session(system_prompt=scenario.system)
    for turn in scenario.earlier:
        session.send(**_as_send(turn), max_new_tokens=new_tokens, speak=scenario.speak).result()
    return session.send(**_as_send(last), max_new_tokens=new_tokens, speak=scenario.speak).result()


def transformers_run(app: OmniLocal, scenario: Scenario, run: int, new_tokens: int) -> dict[str, float]:
    """`thinker.generate` on the whole conversation (earlier replies included): the first token
    alone, then a whole reply."""
    session = app.session(system_prompt=scenario.system)
    for turn in scenario.earlier:
        session.send(**_as_send(turn), max_new_tokens=new_tokens).result()
    prompt = build_prompt([*session.history, _question(scenario, run)], app.loaded.processor)
    inputs = {k: v.to(app.loaded.device) if isinstance(v, torch.Tensor) else v
              for k, v in prompt.model_inputs(app.loaded.processor).items()}
    if scenario.speak:
        return _transformers_speech(app, inputs, prompt.num_tokens, new_tokens)
    thinker = app.loaded.model.thinker

    def timed(tokens: int) -> float:
        with torch.inference_mode():
            return elapsed_s(lambda: thinker.generate(**inputs, max_new_tokens=tokens, min_new_tokens=tokens,
                                                      do_sample=False))

    first, whole = timed(1), timed(new_tokens)
    itl = (whole - first) / (new_tokens - 1)
    return {"ttft_ms": first * 1e3, "itl_ms": itl * 1e3, "prompt": prompt.num_tokens, "computed": prompt.num_tokens}


def _transformers_speech(app: OmniLocal, inputs: dict, prompt_tokens: int, new_tokens: int) -> dict[str, float]:
    """`generate(return_audio=True)` with as many text tokens and codec frames as our replies may have:
    its first audio is its whole run, since nothing streams."""
    frames = app.engine.speaker.max_frames
    audio = []

    def generate() -> None:
        with torch.inference_mode():
            _, wav = app.loaded.model.generate(
                **inputs, thinker_max_new_tokens=new_tokens, thinker_min_new_tokens=new_tokens,
                thinker_do_sample=False, talker_max_new_tokens=frames + 1, talker_min_new_tokens=frames + 1,
            )
        audio.append(wav.shape[-1] / SAMPLE_RATE)

    whole = elapsed_s(generate)
    return {"ttft_ms": float("nan"), "itl_ms": float("nan"), "prompt": prompt_tokens, "computed": prompt_tokens,
            "first_audio_ms": whole * 1e3, "rtf": whole / audio[0], "audio_s": audio[0]}


def _as_send(message: Message) -> dict:
    return {"text": message.text, "images": message.images(), "audio": message.audios(), "videos": message.videos()}


def main() -> None:
    parser = bench_parser("python -m omni_local.bench")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--only", action="append", default=[], metavar="TEXT",
                        help="run only the scenarios whose name holds TEXT (repeatable)")
    args = parser.parse_args()
    settings, loaded = settings_and_model(args)
    rows = []
    every_cache_off = settings.replace(prefix_cache=False, encoder_cache=False)
    with OmniLocal(settings, loaded=loaded) as cached, OmniLocal(every_cache_off, loaded) as cold:
        systems = (("omni_local, cache on", cached, engine_run), ("omni_local, cache off", cold, engine_run),
                   ("transformers", cold, transformers_run))
        chosen = (scenarios() + (video_scenarios() if video_supported(cached.loaded.processor) else [])
                  + (spoken_scenarios() if cached.engine.speaker else []))
        for scenario in [s for s in chosen if not args.only or any(text in s.name for text in args.only)]:
            for system, app, run in systems:
                if "first send" in scenario.name and system.endswith("cache on"):
                    continue  # a first send has nothing to reuse: the cache-off row is the same
                result = median_of(args.runs, lambda i: run(app, scenario, i, args.new_tokens))
                rows.append({"scenario": scenario.name, "system": system, **result})
        environment = _environment(cached, args)
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
    lines += [("| scenario | prompt tokens | system | computed | TTFT (ms) | ITL (ms) | first audio (ms) | RTF |"
               " audio (s) |"), "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        speech = f"{r['first_audio_ms']:.1f} | {r['rtf']:.2f} | {r['audio_s']:.2f}" if "rtf" in r else "– | – | –"
        lines.append(f"| {r['scenario']} | {r['prompt']:.0f} | {r['system']} | {r['computed']:.0f} | "
                     f"{r['ttft_ms']:.1f} | {r['itl_ms']:.2f} | {speech} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
