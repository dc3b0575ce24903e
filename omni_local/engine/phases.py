"""Named spans of the engine's work, for torch.profiler (bench.profile_turn shows where a request's
time to first token goes: building its prompt, encoding its media, its prefill, its first token).

A span costs a dispatcher call, so it is made only while a profiler runs; otherwise a phase is a
null context. The engine's spans are per turn or per request (never per layer or kernel)."""

from contextlib import AbstractContextManager, nullcontext

import torch.autograd.profiler
from torch.profiler import record_function

BUILD_PROMPT = "engine: build prompt"  # the chat template and tokenizer, and fitting the context
CLAIM_KV = "engine: match and claim KV"  # the prefix cache's lookup and the request's blocks
PREPARE = "engine: prepare prompt"  # positions, embeddings, media (ENCODE_MEDIA)
ENCODE_MEDIA = "engine: encode media"  # the encoders, or the encoder cache
PREFILL = "engine: prefill forward"  # one part of a prompt through the Thinker
CHOOSE_FIRST = "engine: choose first token"  # its sampling queued after the prompt's last part
FIRST_TOKEN = "engine: first token"  # read back, the prompt's blocks published
DECODE = "engine: queue decode step"
COLLECT = "engine: read decode step"  # waits for the step queued the turn before
BEGIN_SPEECH = "engine: begin speech"  # the Talker's prompt, from the rows the Thinker kept
SPEECH_FRAME = "engine: speech frame"  # a Talker step, its code predictor, the codec's audio

PHASES = [BUILD_PROMPT, CLAIM_KV, PREPARE, ENCODE_MEDIA, PREFILL, CHOOSE_FIRST, FIRST_TOKEN, DECODE, COLLECT,
          BEGIN_SPEECH, SPEECH_FRAME]


def phase(name: str) -> AbstractContextManager:
    """A span named `name` while torch.profiler runs (on any thread, given its profile_all_threads)."""
    return record_function(name) if torch.autograd.profiler._is_profiler_enabled else nullcontext()
