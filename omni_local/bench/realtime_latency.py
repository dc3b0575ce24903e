"""Time to first audio in a realtime session: from the end of speech to the reply's first audio,
as the server sees it and as a client over the socket sees it.

    python -m omni_local serve --speech true ...           # the server, in another shell
    python -m omni_local.bench.realtime_latency http://127.0.0.1:8000/v1 --turns 5
    python -m omni_local.bench.realtime_latency --random-weights CONFIG.json --weights int4 --turns 5

Without a URL the bench serves the model of its settings itself (speech on), in this process on a
free port, as `serve` does: `--random-weights` gives full-size random weights, for a GPU machine
that has no checkpoint.

A client of the `openai` package's realtime client streams a recorded question (a WAV file, any
rate, mono) in real time, 20 ms chunks, then silence, as a microphone would, with server VAD on
(`--silence-ms` of silence ends an utterance). Each turn waits for the reply's end before the next
question, so no turn cuts the one before. For each turn:

- server: `response.done`'s `omni_local.first_audio_ms`, from the response being asked for (just
  after the server sent `speech_stopped`) to its first audio delta sent;
- client: from `speech_stopped` received to the first `response.output_audio.delta` received.

Neither includes the VAD's silence window itself (the person has stopped speaking `--silence-ms`
before `speech_stopped`): the table states it. The first turn pays first-use costs; the medians
are over the turns after it. Prints a table; `--json` writes the turns.
"""

import argparse
import asyncio
import base64
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import soundfile
import soxr

from omni_local.api import OmniLocal
from omni_local.bench.common import SERVING_MODULES, bench_model, bench_parser, require_modules, served
from omni_local.settings import settings_from_arguments

RATE = 24_000
CHUNK = RATE // 50  # 20 ms
DEFAULT_WAV = Path(__file__).resolve().parents[2] / "tests" / "support" / "data" / "speech.wav"


@dataclass(frozen=True)
class Turn:
    server_ms: float | None
    client_ms: float | None
    cached_tokens: int | None


def question(path: Path) -> bytes:
    """The WAV as PCM16 at 24 kHz, mono."""
    samples, rate = soundfile.read(path, dtype="float32", always_2d=True)
    samples = soxr.resample(samples.mean(axis=1), rate, RATE)
    return np.round(np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes()


async def stream(connection, pcm: bytes, done: asyncio.Event) -> None:
    """`pcm` in real time, then silence until `done` is set."""
    silence = bytes(CHUNK * 2)
    start, sent = time.perf_counter(), 0
    pieces = [pcm[at:at + CHUNK * 2] for at in range(0, len(pcm), CHUNK * 2)]
    while pieces or not done.is_set():
        piece = pieces.pop(0) if pieces else silence
        await connection.input_audio_buffer.append(audio=base64.b64encode(piece).decode())
        sent += 1
        await asyncio.sleep(max(0.0, start + sent * 0.02 - time.perf_counter()))


async def one_turn(connection, pcm: bytes) -> Turn:
    done = asyncio.Event()
    sender = asyncio.create_task(stream(connection, pcm, done))
    stopped_at = first_audio_at = None
    try:
        while True:
            event = await connection.recv()
            now = time.perf_counter()
            if event.type == "input_audio_buffer.speech_stopped":
                stopped_at = now
            elif event.type == "response.output_audio.delta" and first_audio_at is None:
                first_audio_at = now
            elif event.type == "error":
                raise RuntimeError(event.error.message)
            elif event.type == "response.done":
                break
    finally:
        done.set()
        await sender
    figures = (event.response.model_extra or {}).get("omni_local") or {}
    usage = event.response.usage
    client_ms = None if None in (stopped_at, first_audio_at) else round((first_audio_at - stopped_at) * 1000, 1)
    return Turn(figures.get("first_audio_ms"), client_ms,
                usage.input_token_details.cached_tokens if usage and usage.input_token_details else None)


async def run(url: str, key: str, model: str, pcm: bytes, turns: int, silence_ms: int) -> list[Turn]:
    from openai import AsyncOpenAI  # the realtime client needs the websockets package

    client = AsyncOpenAI(base_url=url, api_key=key, max_retries=0)
    async with client.realtime.connect(model=model, max_retries=0) as connection:
        vad = {"type": "server_vad", "silence_duration_ms": silence_ms}
        await connection.session.update(session={"type": "realtime", "output_modalities": ["audio"],
                                                 "audio": {"input": {"turn_detection": vad}}})
        return [await one_turn(connection, pcm) for _ in range(turns)]


def median(values: list[float | None]) -> str:
    known = [value for value in values if value is not None]
    return f"{statistics.median(known):.1f}" if known else "n/a"


def served_turns(args: argparse.Namespace, pcm: bytes) -> list[Turn]:
    """The turns against the server at `args.url`, or against this process's own app, served."""
    if args.url:
        return asyncio.run(run(args.url, args.key, args.model_id, pcm, args.turns, args.silence_ms))
    settings = settings_from_arguments(args).replace(speech=True)
    with OmniLocal(settings, loaded=bench_model(settings, args.random_weights)) as app, served(app) as url:
        return asyncio.run(run(url, args.key, app.info.model_id, pcm, args.turns, args.silence_ms))


def main() -> None:
    parser = bench_parser("python -m omni_local.bench.realtime_latency", timed=False)
    parser.add_argument("url", nargs="?", help="the API's base URL, e.g. http://127.0.0.1:8000/v1; without it, "
                                               "the model of these settings served here")
    parser.add_argument("--wav", type=Path, default=DEFAULT_WAV, help="the spoken question")
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--silence-ms", type=int, default=500, help="server VAD's silence window")
    parser.add_argument("--model-id", default="demo", help="the served model's id, with a URL")
    parser.add_argument("--key", default="no key")
    parser.add_argument("--json", type=Path, help="write the turns here")
    args = parser.parse_args()
    require_modules(("openai", "websockets") if args.url else SERVING_MODULES, "the realtime bench")
    turns = served_turns(args, question(args.wav))
    print(f"VAD silence window {args.silence_ms} ms (not counted below); first turn apart")
    print("turn | server: asked to first audio (ms) | client: speech_stopped to first audio (ms) | cached tokens")
    for index, turn in enumerate(turns, 1):
        print(f"{index} | {turn.server_ms} | {turn.client_ms} | {turn.cached_tokens}")
    later = turns[1:] or turns
    print(f"median of turns 2+ | {median([t.server_ms for t in later])} | {median([t.client_ms for t in later])} |")
    if args.json:
        args.json.write_text(json.dumps({"silence_ms": args.silence_ms, "turns": [asdict(t) for t in turns]}))


if __name__ == "__main__":
    main()
