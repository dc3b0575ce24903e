"""What a request asks for: how to sample its reply, and whether (and how) to speak it."""

import math
import numbers
import reprlib
from dataclasses import dataclass, fields

import numpy as np

from omni_local.errors import RequestError

_WHOLE = {"max_new_tokens", "max_reasoning_tokens", "top_k", "seed", "logprobs"}
_UNSET_ALLOWED = {"seed", "logprobs"}  # None is a value of theirs: a fresh seed; no log-probabilities
MAX_TOP_LOGPROBS = 20  # alternatives per token a reply may report, as OpenAI allows
# Below this a temperature divides the scores past float32's range (every positive one infinite,
# and the draw then picks the lowest such id): values that small are refused; 0 is greedy.
MIN_TEMPERATURE = 1e-3


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 512
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no limit
    repetition_penalty: float = 1.0
    seed: int | None = None  # None: a fresh random seed, reported in the result
    # A Thinking checkpoint's reasoning is ended after this many tokens, so that it answers; 0: no limit.
    max_reasoning_tokens: int = 0
    # None: none; k: each answer token's log-probability and the k likeliest in its place (events.py)
    logprobs: int | None = None

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if field.name not in _UNSET_ALLOWED or value is not None:
                object.__setattr__(self, field.name, _number(field.name, value, whole=field.name in _WHOLE))
        # The ranges hold for the values as the device keeps them, in float32, where 1e39 is infinite
        # and 1e-50 is 0. A NaN fails every comparison.
        with np.errstate(over="ignore"):
            temperature, top_p, penalty = np.array(
                [self.temperature, self.top_p, self.repetition_penalty], dtype=np.float32).tolist()
        checks = [
            (self.max_new_tokens >= 1, "max_new_tokens must be at least 1"),
            (temperature == 0 or MIN_TEMPERATURE <= temperature < math.inf,
             f"temperature must be 0 (greedy) or a finite number of at least {MIN_TEMPERATURE}"),
            (0 < top_p <= 1, "top_p must be in (0, 1]"),
            (self.top_k >= 0, "top_k must be 0 (off) or more"),
            (self.max_reasoning_tokens >= 0, "max_reasoning_tokens must be 0 (no limit) or more"),
            (0 < penalty < math.inf, "repetition_penalty must be a finite number above 0"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_TOP_LOGPROBS,
             f"logprobs must be None (off) or a number of alternatives from 0 to {MAX_TOP_LOGPROBS}"),
        ]
        for ok, message in checks:
            if not ok:
                raise RequestError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class SpeechParams:
    """A request for a spoken reply. The Talker samples as Qwen's defaults do; temperature 0 makes
    the Talker and its code predictor greedy."""

    voice: str
    temperature: float = 0.9
    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.05

    def __post_init__(self) -> None:
        self.talker_sampling()  # a bad value is a RequestError now, not in the engine

    def talker_sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                              repetition_penalty=self.repetition_penalty)


def _number(name: str, value: object, whole: bool) -> int | float:
    """`value` as a plain int (`whole`) or float; a string, a bool or a fraction where a whole
    number belongs is refused."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral if whole else numbers.Real):
        raise RequestError(f"{name} must be {'a whole number' if whole else 'a number'}, not {reprlib.repr(value)}")
    return int(value) if whole else float(value)
