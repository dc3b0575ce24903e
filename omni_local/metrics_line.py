"""A finished reply's figures as one line for people (the CLI prints it, the page shows it): how
fast, what the caches supplied, what the prompt left out, and why the reply ended where that is news.
A figure the backend did not report is left out, or said to be unknown: never shown as a zero."""

from omni_local.protocol.events import ContextUse, Finished, MediaCounts, SpeechReport, TokenCounts, Timings

# A reply that ended on its own says nothing of it; the other ends are news to the person.
_STOP_WORDS = {"max_new_tokens": "reply length limit reached", "context_full": "context full", "cancelled": "stopped"}
_NOTICEABLE_WAIT_S = 0.1  # a shorter wait for the engine is lost in the TTFT, which includes it
UNKNOWN = "unknown"


def metrics_line(event: Finished) -> str:
    parts = (_speed(event.timings), _reuse(event.tokens), _generated(event.tokens), _media(event.media),
             _speech(event.speech), _left_out(event.context), _STOP_WORDS.get(event.stop_reason, ""))
    return " · ".join(part for part in parts if part)


# The line's parts: each is "" where it has nothing to say.


def _speed(t: Timings) -> str:
    ttft = _duration(t.ttft_s) if t.ttft_s is not None else UNKNOWN
    queued = f" (queued {_duration(t.queue_wait_s)})" if (t.queue_wait_s or 0) >= _NOTICEABLE_WAIT_S else ""
    rate = f" · {_figure(t.decode_tokens_per_s)} tok/s" if t.decode_tokens_per_s else ""
    return f"TTFT {ttft}{queued}{rate}"


def _reuse(n: TokenCounts) -> str:
    prompt = f"{n.prompt:,}" if n.prompt is not None else UNKNOWN
    reused = f"{n.reused:,}" if n.reused is not None else UNKNOWN
    host = f" ({n.reused_host:,} from host memory)" if n.reused_host else ""
    return f"{reused} of {prompt} prompt tokens from cache{host}"


def _generated(n: TokenCounts) -> str:
    return _counted(n.generated, "reply token") if n.generated is not None else ""


def _media(m: MediaCounts | None) -> str:
    if m is None or not (m.in_kv or m.from_cache or m.encoded):
        return ""
    return f"media: {m.encoded} encoded, {m.from_cache} from the encoder cache, {m.in_kv} in the cached prompt"


def _speech(s: SpeechReport | None) -> str:
    if s is None:
        return ""
    first = f", first audio {_duration(s.first_audio_s)}" if s.first_audio_s is not None else ""
    factor = f", real-time factor {s.real_time_factor:.2f}" if s.real_time_factor is not None else ""
    return f"{s.audio_s:.1f} s of speech ({s.voice}){first}{factor}"


def _left_out(c: ContextUse) -> str:
    if not c.turns_left_out:
        return ""
    limit = f" to fit {c.prompt_limit:,} tokens" if c.prompt_limit is not None else ""
    return f"{_counted(c.turns_left_out, 'earlier turn')} left out{limit}"


def _duration(seconds: float) -> str:
    return f"{_figure(seconds * 1000)} ms" if seconds < 1 else f"{_figure(seconds)} s"


def _figure(value: float) -> str:
    """Two or three figures, as a person reads them at a glance: 3.2, 17, 1,420."""
    return f"{value:,.1f}" if value < 10 else f"{value:,.0f}"


def _counted(count: int, noun: str) -> str:
    return f"{count:,} {noun}{'' if count == 1 else 's'}"
