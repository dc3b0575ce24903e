"""The engine in this process as a backend: the model loaded here, media decoded here."""

import logging
from collections.abc import Iterator
from dataclasses import replace
from functools import partial
from pathlib import Path

import numpy as np
import torch

from omni_local.access import LOCAL_USER
from omni_local.engine.engine import Engine
from omni_local.engine.request import Failed, Request
from omni_local.engine.sizing import host_memory
from omni_local.engine.sizing.memory_plan import MemoryPlan, engine_baseline, plan_memory, remember_engine_bytes
from omni_local.errors import MediaError, RequestError, SettingsError
from omni_local.media import SAMPLE_RATE, MediaLimits
from omni_local.media.audio import check_samples
from omni_local.media.video import Video, load_video
from omni_local.model.host_experts import keep_in_host_memory
from omni_local.model.loader import LoadedModel, load_model, quiet_library_logs, resolve_device
from omni_local.model.workarounds import video_refusal, video_supported
from omni_local.protocol.backend import BackendInfo
from omni_local.protocol.events import Event, Finished
from omni_local.protocol.kinds import conversation_for
from omni_local.protocol.messages import Message
from omni_local.protocol.params import SamplingParams, SpeechParams
from omni_local.protocol.tool_calls import read_tool_calls
from omni_local.protocol.tools import ToolUse
from omni_local.settings import Settings
from omni_local.start_up_steps import start_up_step

log = logging.getLogger(__name__)


class LocalReply:
    """A request in the engine, read as a stream of events; with `tools`, the calls read from its text."""

    def __init__(self, request: Request, tools: ToolUse | None = None) -> None:
        self.request = request
        self.tools = tools

    def events(self) -> Iterator[Event]:
        return self._engine_events() if self.tools is None else read_tool_calls(self._engine_events(), self.tools)

    def _engine_events(self) -> Iterator[Event]:
        while True:
            event = self.request.events.get()
            if isinstance(event, Failed):
                raise RequestError(event.message)
            yield event
            if isinstance(event, Finished):
                return

    def cancel(self) -> None:
        self.request.cancelled.set()


class LocalBackend:
    def __init__(self, settings: Settings, loaded: LoadedModel | None = None, wait_for_graphs: bool = True) -> None:
        """`wait_for_graphs`: return once every CUDA graph is captured; else as soon as the engine
        serves, its prefill graphs captured while it is idle (Engine's `warm`)."""
        self.settings = settings
        # What the loader, the memory plan and the engine read: they are given these groups alone.
        self.engine_config = settings.for_engine()
        self.limits = MediaLimits.from_settings(settings)
        quiet_library_logs()  # transformers' load-time notes and progress bars are not for users
        self.memory: MemoryPlan | None = None
        if loaded is None:
            with start_up_step("the model loaded"):
                loaded = load_model(self.engine_config, before_loading=self._plan_memory)
        self.loaded = loaded
        # The KV and the encoder outputs as the plan sized them, up to their settings.
        sized = self.engine_config if self.memory is None else self.memory.applied(self.engine_config)
        # In host memory (and on the CPU, all of it) as much as the machine's memory allows.
        self.host_memory = host_memory.plan_for(self.loaded, sized)
        log.info("%s", self.host_memory.line())
        baseline = engine_baseline(self.loaded.device) if self.memory is not None else 0
        # Once every graph is captured the engine's take is whole: measured then, for the next plan.
        try:
            self.engine = Engine(self.loaded, self.host_memory.applied(sized), settings.max_prompt_tokens,
                                 warm_up_later=True, when_warm=partial(self._remember_engine_bytes, baseline))
        except torch.OutOfMemoryError:
            # Seen on a 22 GiB card's cap (docs/benchmarks/2026-12-08-honest-cap-h100.md): a traceback
            # there tells a user nothing they can change.
            if self.memory is None:
                raise
            raise SettingsError(self.memory.out_of_memory_at_start()) from None
        if wait_for_graphs:
            self.engine.warm.wait()
        self.info = BackendInfo(
            model_id=model_id(settings),
            model=model_name(settings),
            runs_on=f"{str(self.loaded.dtype).removeprefix('torch.')} on {self.loaded.device}"
                    + (f", {self.loaded.quantized}" if self.loaded.quantized else "")
                    + (", deterministic" if settings.deterministic else ""),
            speech=self.loaded.speech,
            voices=self.engine.speaker.voices if self.engine.speaker else [],
            max_context_tokens=settings.max_context_tokens,
            max_prompt_tokens=settings.max_prompt_tokens,
            concurrency=self.engine.seats.count,
            video=video_supported(self.loaded.processor),
            kind=self.loaded.kind,
        )

    def _remember_engine_bytes(self, baseline: int, engine: Engine) -> None:
        if self.memory is not None:
            talker_kv = engine.speaker.runner.kv.allocated_bytes if engine.speaker else 0
            remember_engine_bytes(self.memory, self.engine_config, self.loaded.device, baseline,
                                  engine.runner.kv.allocated_bytes + talker_kv)

    def _plan_memory(self, model: torch.nn.Module) -> None:
        self.memory = plan_memory(model, self.engine_config, resolve_device(self.engine_config.device))
        if self.memory is not None:
            keep_in_host_memory(model, self.memory.experts_on_gpu, self.memory.host_embeddings > 0)
            log.info("%s", self.memory.line())

    def send(self, session: str, messages: list[Message], params: SamplingParams,
             speech: SpeechParams | None, principal: str = LOCAL_USER, tools: ToolUse | None = None) -> LocalReply:
        messages = conversation_for(self.info.kind, messages)
        if tools is None or not tools.offered:
            return LocalReply(self.engine.submit(session, messages, params, speech, principal))
        tools.check(self.info.kind)
        speech = None if tools.reply_prefix else speech  # a reply begun inside a call has nothing to speak
        return LocalReply(self.engine.submit(session, tools.conversation(messages), params, speech, principal,
                                             calls=True), tools)

    def read_video(self, item: str | Path | bytes | Video) -> Video:
        """A video as the model takes it: frames at the checkpoint's rate (else `video_fps`), and its
        sound track if `use_audio_in_video` (a silent clip then gets silence, so every video of a
        prompt is laid out alike)."""
        if not self.info.video:
            raise MediaError(video_refusal(self.loaded.processor))
        video = item
        if not isinstance(video, Video):
            processor = self.loaded.processor.video_processor
            fps = getattr(processor, "fps", None) or self.settings.video_fps
            video = load_video(video, self.limits, fps, processor.min_frames, processor.max_frames)
        elif video.audio is not None:
            check_samples(video.name, video.audio, "the sound track")  # as a file's is
        if not self.settings.use_audio_in_video:
            return replace(video, audio=None)
        if video.audio is None:
            return replace(video, audio=np.zeros(round(video.seconds * SAMPLE_RATE), np.float32))
        return video

    def close(self) -> None:
        self.engine.close()


def model_id(settings: Settings) -> str:
    return "demo" if settings.model == "demo" else Path(settings.model).expanduser().resolve().name


def model_name(settings: Settings) -> str:
    return "demo model: random weights, replies are noise" if settings.model == "demo" else model_id(settings)
