"""The baseline: plain transformers' `generate` on the same conversations, its inputs prepared
beforehand (the engine's rows include the chat template, tokenizing and media preprocessing)."""

import time

import torch
from transformers.generation.streamers import BaseStreamer

from omni_local.api import OmniLocal
from omni_local.bench.common import elapsed_s, medians, synced_now
from omni_local.bench.scenarios import Scenario, opened, question
from omni_local.engine.prompt.builder import Prompt, build_prompt
from omni_local.engine.prompt.encoder_inputs import transformers_inputs
from omni_local.protocol.events import SPEECH_SAMPLE_RATE


def transformers_run(app: OmniLocal, scenario: Scenario, run: int, new_tokens: int) -> dict[str, float]:
    """`thinker.generate` on the whole conversation (earlier replies included). Concurrent chats'
    requests run one after another, each waiting for the whole replies before it."""
    histories = [opened(app, scenario, run, chat, new_tokens, speak=False).history
                 for chat in range(scenario.concurrency)]
    prompts = [build_prompt([*history, question(scenario, run, chat)], app.backend.loaded.processor)
               for chat, history in enumerate(histories)]
    if scenario.speak:
        return _transformers_speech(app, _inputs(app, prompts[0]), prompts[0].num_tokens, new_tokens)
    samples, queued_s = [], 0.0
    for prompt in prompts:
        first, itl, whole = _timed_generate(app, _inputs(app, prompt), new_tokens)
        samples.append({"ttft_ms": (queued_s + first) * 1e3, "itl_ms": itl * 1e3, "prompt": prompt.num_tokens,
                        "computed": prompt.num_tokens})
        queued_s += whole
    return medians(samples)


def _inputs(app: OmniLocal, prompt: Prompt) -> dict:
    device = app.backend.loaded.device  # the pixels preprocessed there, as the engine's are
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v
            for k, v in transformers_inputs(prompt, app.backend.loaded.processor, device).items()}


class _TokenClock(BaseStreamer):
    """When `generate` hands out its tokens: the prompt first, then each new one (moved to the host,
    so its compute is done)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _timed_generate(app: OmniLocal, inputs: dict, tokens: int) -> tuple[float, float, float]:
    """Seconds to the first new token, per token after it, and in all, of one `thinker.generate`."""
    clock = _TokenClock()
    start = synced_now()
    with torch.inference_mode():
        app.backend.loaded.model.thinker.generate(**inputs, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                                          streamer=clock)
    whole = synced_now() - start
    first, last = clock.times[1], clock.times[-1]
    itl = (last - first) / (tokens - 1) if tokens > 1 else float("nan")
    return first - start, itl, whole


def _transformers_speech(app: OmniLocal, inputs: dict, prompt_tokens: int, new_tokens: int) -> dict[str, float]:
    """`generate(return_audio=True)` with as many text tokens and codec frames as our replies may have:
    its first audio is its whole run, since nothing streams."""
    frames = app.backend.engine.speaker.max_frames
    audio = []

    def generate() -> None:
        with torch.inference_mode():
            _, wav = app.backend.loaded.model.generate(
                **inputs, thinker_max_new_tokens=new_tokens, thinker_min_new_tokens=new_tokens,
                thinker_do_sample=False, talker_max_new_tokens=frames + 1, talker_min_new_tokens=frames + 1,
            )
        audio.append(wav.shape[-1] / SPEECH_SAMPLE_RATE)

    whole = elapsed_s(generate)
    return {"ttft_ms": float("nan"), "itl_ms": float("nan"), "prompt": prompt_tokens, "computed": prompt_tokens,
            "first_audio_ms": whole * 1e3, "rtf": whole / audio[0], "audio_s": audio[0]}
