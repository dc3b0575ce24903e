"""A remote reply's final figures: what our server reports of itself, else what any server's
`usage` says and what this side measures; a figure neither knows is None (shown as unknown).

Our server (`python -m omni_local serve`) puts an `"omni_local"` object on its last chunk with the
engine's own figures, by the names of protocol/events.py (server/figures.py, which writes it, lists them).
Another server's `usage` gives the prompt and reply token counts, and `cached_tokens` the prompt
tokens its prefix cache supplied (device and host memory together); the time to the first token and
the decode rate are then measured here, so they include the network.
"""

import time
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any, get_args

from omni_local.backends.remote.chunks import ChunkReader
from omni_local.protocol.events import (
    SPEECH_SAMPLE_RATE,
    AudioChunk,
    ContextUse,
    Finished,
    MediaCounts,
    ReasoningDelta,
    SpeechReport,
    StopReason,
    TextDelta,
    Timings,
    TokenCounts,
)
from omni_local.protocol.functions import ToolCall

_FINISH_REASONS: dict[str, StopReason] = {"length": "max_new_tokens", "stop": "end_of_turn",
                                           "tool_calls": "end_of_turn"}


@dataclass
class ReplyTally:
    """What of the reply came, and when, by this side's clock."""

    sent: float = field(default_factory=time.monotonic)
    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    audio_samples: int = 0  # at 24 kHz
    calls: list[ToolCall] = field(default_factory=list)
    first_text: float | None = None
    last_text: float | None = None
    first_audio: float | None = None

    def add(self, event: TextDelta | ReasoningDelta | AudioChunk | ToolCall) -> None:
        now = time.monotonic()
        if isinstance(event, ToolCall):
            self.calls.append(event)
        elif isinstance(event, TextDelta | ReasoningDelta):
            (self.text if isinstance(event, TextDelta) else self.reasoning).append(event.text)
            self.first_text = self.first_text or now
            self.last_text = now
        else:
            self.audio_samples += event.samples.size
            self.first_audio = self.first_audio or now

    def decode_rate(self, generated: int | None) -> float | None:
        """Reply tokens after the first, per second of text streaming (0 for one token), as the engine counts it."""
        if generated is None or self.first_text is None:
            return None
        if generated <= 1:
            return 0.0
        span = self.last_text - self.first_text
        return (generated - 1) / span if span > 0 else None


@dataclass(frozen=True)
class Asked:
    """What the request asked for, and of what server, for its reply's final figures."""

    seed: int | None  # the seed sent, if any
    voice: str | None  # for a spoken reply
    limits: ContextUse  # the server's context size and prompt limit, as its model entry gave them


def finished(asked: Asked, reader: ChunkReader, tally: ReplyTally, cancelled: bool) -> Finished:
    """The reply's final event; `cancelled`: `cancel` cut its stream short."""
    report = reader.report
    if report is not None and not cancelled:
        return _reported(asked, report, tally, reader)
    usage = reader.usage or {}
    prompt, generated = _count(usage.get("prompt_tokens")), _count(usage.get("completion_tokens"))
    cached = _count((usage.get("prompt_tokens_details") or {}).get("cached_tokens"))
    computed = prompt - cached if prompt is not None and cached is not None else None
    ttft = tally.first_text - tally.sent if tally.first_text is not None else None
    return Finished(
        text="".join(tally.text), token_ids=None, stop_reason=_stop_reason(reader, cancelled),
        tokens=TokenCounts(prompt, computed, cached, None, generated),
        timings=Timings(None, ttft, tally.decode_rate(generated)),
        seed=asked.seed, context=asked.limits, speech=_measured_speech(asked, tally), media=None,
        reasoning="".join(tally.reasoning), tool_calls=tuple(tally.calls),
    )


def _reported(asked: Asked, report: dict[str, Any], tally: ReplyTally, reader: ChunkReader) -> Finished:
    stop = report.get("stop_reason")
    context = _record(ContextUse, report.get("context"))
    media = report.get("media")
    return Finished(
        text="".join(tally.text), token_ids=None,
        stop_reason=stop if stop in get_args(StopReason) else _stop_reason(reader, cancelled=False),
        tokens=_record(TokenCounts, report.get("tokens")),
        timings=_record(Timings, report.get("timings")),
        seed=_count(report.get("seed", asked.seed)),
        context=ContextUse(context.size or asked.limits.size, context.prompt_limit or asked.limits.prompt_limit,
                           context.turns_left_out),
        speech=_reported_speech(asked, report.get("speech"), tally),
        media=_record(MediaCounts, media) if isinstance(media, dict) else None,
        reasoning="".join(tally.reasoning), tool_calls=tuple(tally.calls),
    )


def _stop_reason(reader: ChunkReader, cancelled: bool) -> StopReason:
    if cancelled:
        return "cancelled"
    return _FINISH_REASONS.get(reader.finish_reason or "stop", "end_of_turn")


def _measured_speech(asked: Asked, tally: ReplyTally) -> SpeechReport | None:
    if asked.voice is None:
        return None
    first = tally.first_audio - tally.sent if tally.first_audio is not None else None
    return SpeechReport(voice=asked.voice, frames=None, audio_s=tally.audio_samples / SPEECH_SAMPLE_RATE,
                        first_audio_s=first, real_time_factor=None)


def _reported_speech(asked: Asked, speech: Any, tally: ReplyTally) -> SpeechReport | None:
    """The server's speech figures, with what this side measured where it left a figure out."""
    measured = _measured_speech(asked, tally)
    if measured is None or not isinstance(speech, dict):
        return measured
    reported = _record(SpeechReport, speech)
    return replace(reported, voice=reported.voice or measured.voice,
                   audio_s=reported.audio_s if reported.audio_s is not None else measured.audio_s)


def _record(kind: type, values: Any) -> Any:
    """`kind` from a report's object: each field's value if it is a number or a name, else its
    default where it has one, else None (unknown)."""
    values = values if isinstance(values, dict) else {}
    known = {}
    for f in fields(kind):
        value = values.get(f.name)
        if not isinstance(value, (int, float, str)) or isinstance(value, bool):
            value = f.default if f.default is not MISSING else None
        known[f.name] = value
    return kind(**known)


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
