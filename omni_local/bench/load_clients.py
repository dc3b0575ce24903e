"""The load bench's clients: each a user asking one question after another, each its own, timed as
the reply streams in. They run on any `OmniLocal`: the engine in this process (the Python API), or
the remote backend, whose `openai` client streams from our server.

The HTTP clients run in a process of their own, `python -m omni_local.bench.load_clients URL`, the
row's `LoadSpec` as JSON on stdin, its samples as JSON on stdout: 64 clients parsing their streams
in the server's process would take the interpreter's lock from the engine's step loop, which a real
client elsewhere never does. This module imports no torch, so that process starts in a second.
"""

import dataclasses
import json
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
from PIL import Image

from omni_local.api import AudioChunk, Finished, OmniLocal, OmniLocalError, Reply, TextDelta
from omni_local.protocol.events import SPEECH_SAMPLE_RATE
from omni_local.settings import Settings

MEDIA = ("none", "image", "audio")
IMAGE_SIZE = (480, 640)  # (height, width) of each request's own picture
CLIP_SECONDS = 5.0  # each request's own clip, 16 kHz mono
COMPLETE = ("end_of_turn", "max_new_tokens")  # a reply the engine ended itself, not cut or out of room


@dataclass(frozen=True)
class LoadSpec:
    """What one row's clients send: `clients` of them, each sending its next request once its last
    reply has ended, until `seconds` have passed (each sends one at least)."""

    row: int  # each row's questions are its own, so no row finds another's in the prefix cache
    clients: int
    seconds: float
    system: str
    words: list[str]  # each one token, with its leading space (one_token_words)
    question_tokens: int
    new_tokens: int
    speak: bool
    media: str = "none"  # one of MEDIA: what each question brings besides its text


@dataclass(frozen=True)
class Sample:
    """One request as its client saw it; times from just before `send`."""

    complete: bool  # ended by the engine, its streamed text and audio all the reply reported (_complete)
    generated: int  # reply tokens
    ttft_s: float  # to the first text
    gaps_s: list[float] = field(default_factory=list)  # between one piece of text and the next
    first_audio_s: float | None = None
    rtf: float | None = None  # to the last audio, over the audio's duration
    queue_wait_s: float | None = None  # the engine's own, where the backend reports it
    failure: str = ""  # why a request failed, raised instead of a reply

    @staticmethod
    def failed(why: str) -> "Sample":
        return Sample(False, 0, float("nan"), failure=why)


def one_token_words(tokenizer) -> list[str]:
    """The tokenizer's whole lowercase words of three letters or more that are one token each with
    their leading space: text of them is as many tokens as words."""
    return sorted(token[1:] for token in tokenizer.get_vocab()
                  if token.startswith("Ġ") and len(token) > 3 and token[1:].isascii() and token[1:].isalpha()
                  and token[1:].islower())


def question_text(spec: LoadSpec, client: int, number: int) -> str:
    """The `number`th question of `client` in row `spec.row`: about `spec.question_tokens` words drawn
    for it alone, so two clients' prompts differ all through (as real users' do, routed to other
    experts), not only in a tag."""
    rng = np.random.default_rng((spec.row, client, number))
    return " ".join(rng.choice(spec.words, spec.question_tokens))


def request_media(spec: LoadSpec, client: int, number: int) -> dict:
    """The request's own picture or clip (noise drawn for it), as `Session.send` takes it."""
    rng = np.random.default_rng((spec.row, client, number, 1))
    if spec.media == "image":
        return {"images": [Image.fromarray(rng.integers(0, 256, (*IMAGE_SIZE, 3), dtype=np.uint8))]}
    if spec.media == "audio":
        return {"audio": [(rng.standard_normal(round(16_000 * CLIP_SECONDS)) * 0.1).astype(np.float32)]}
    return {}


def one_request(app: OmniLocal, spec: LoadSpec, client: int, number: int) -> Sample:
    """A new chat's first question, its reply read to the end and timed."""
    session = app.session(system_prompt=spec.system)
    start = time.perf_counter()
    try:
        reply = session.send(question_text(spec, client, number), **request_media(spec, client, number),
                             speak=spec.speak, max_new_tokens=spec.new_tokens)
        return timed(reply, start, spec.speak)
    except OmniLocalError as error:
        return Sample.failed(str(error))


def timed(reply: Reply, start: float, speak: bool) -> Sample:
    texts, text_at, audio_at, samples, final = [], [], [], 0, None
    for event in reply:
        now = time.perf_counter() - start
        if isinstance(event, TextDelta):
            texts.append(event.text)
            text_at.append(now)
        elif isinstance(event, AudioChunk):
            audio_at.append(now)
            samples += len(event.samples)
        elif isinstance(event, Finished):
            final = event
    audio_s = samples / SPEECH_SAMPLE_RATE
    return Sample(
        complete=_complete(final, "".join(texts), samples, speak), generated=final.tokens.generated or 0,
        ttft_s=text_at[0] if text_at else float("nan"), gaps_s=np.diff(text_at).tolist(),
        first_audio_s=audio_at[0] if audio_at else None, rtf=audio_at[-1] / audio_s if audio_at else None,
        queue_wait_s=final.timings.queue_wait_s,
    )


def _complete(final: Finished, text: str, samples: int, speak: bool) -> bool:
    """Ended by the engine (an end of turn may come first: a reply of no tokens), with every piece of
    its text and audio streamed."""
    if final.stop_reason not in COMPLETE or text != final.text:
        return False
    if not speak or not final.tokens.generated:
        return True  # a reply of no tokens has nothing to say
    return final.speech is not None and round(final.speech.audio_s * SPEECH_SAMPLE_RATE) == samples


def closed_loop(clients: int, seconds: float, request: Callable[[int, int], Sample],
                first: int = 0) -> tuple[list[Sample], float]:
    """Each client's requests (numbered from `first`), one after another, until `seconds` have
    passed, and the wall time until the last reply ended."""
    start = time.perf_counter()
    deadline = start + seconds

    def client(number: int) -> list[Sample]:
        samples = [request(number, first)]
        while time.perf_counter() < deadline:
            samples.append(request(number, first + len(samples)))
        return samples

    with ThreadPoolExecutor(clients) as pool:
        per_client = list(pool.map(client, range(clients)))
    return [s for samples in per_client for s in samples], time.perf_counter() - start


def run_row(app: OmniLocal, spec: LoadSpec, warm_up: bool) -> tuple[list[Sample], float]:
    """The row's timed samples and wall time; first, with `warm_up`, one untimed request per client
    at once, so the batch sizes the row reaches are compiled and captured before it is timed."""
    request = lambda client, number: one_request(app, spec, client, number)  # noqa: E731
    if warm_up:
        closed_loop(spec.clients, 0.0, request)
    return closed_loop(spec.clients, spec.seconds, request, first=1)


def main() -> None:
    """The HTTP row's clients, on the server at argv[1]: the spec from stdin, the samples to stdout."""
    asked = json.load(sys.stdin)
    spec = LoadSpec(**asked["spec"])
    with OmniLocal(Settings(backend="openai", backend_url=sys.argv[1])) as app:
        samples, wall_s = run_row(app, spec, asked["warm_up"])
    json.dump({"samples": [dataclasses.asdict(s) for s in samples], "wall_s": wall_s}, sys.stdout)


if __name__ == "__main__":
    main()
