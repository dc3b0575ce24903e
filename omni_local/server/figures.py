"""What a finished reply reports on the wire: OpenAI's `finish_reason` and `usage`, and
omni_local's own figures.

The `omni_local` object is a contract with omni_local's remote backend, which reads it back into a
`Finished`: `dataclasses.asdict` of the reply's `Finished` without its text, token ids, reasoning
and tool calls, so
{"stop_reason", "tokens": {prompt, computed, reused_gpu, reused_host, generated},
"timings": {queue_wait_s, ttft_s, decode_tokens_per_s}, "seed", "context": {size, prompt_limit,
turns_left_out}, "media": {in_kv, from_cache, encoded} or null, "speech": {voice, frames, audio_s,
first_audio_s, real_time_factor, talker_prompt, talker_reused} or null}. A reply cut at a stop
string reports the engine's "cancelled" there, and "stop" as its finish_reason; a reply that called
tools, "tool_calls".
"""

import dataclasses

from omni_local.protocol.events import Finished


def finish_reason(final: Finished) -> str:
    # A reply cut short is "length" even after a whole call, as vLLM and OpenAI say it: the cut may
    # have lost further calls or the call's text, and a client that sees "tool_calls" would act on it.
    if final.stop_reason in ("max_new_tokens", "context_full"):
        return "length"
    return "tool_calls" if final.tool_calls else "stop"


def usage(final: Finished) -> dict:
    """OpenAI's usage; the prompt's tokens from the prefix cache are its cached tokens."""
    prompt, generated = final.tokens.prompt or 0, final.tokens.generated or 0
    return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated,
            "prompt_tokens_details": {"cached_tokens": final.tokens.reused or 0}}


def omni_local_figures(final: Finished) -> dict:
    figures = dataclasses.asdict(final)
    del figures["text"], figures["token_ids"], figures["reasoning"], figures["tool_calls"]
    return figures
