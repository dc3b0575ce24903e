"""Code2Wav in small causal chunks, so audio streams while the Talker is still making codes.

Code2Wav is causal except at its right edge: the last samples a chunk of n frames could give
depend on frame n + 1, so the model crops them (a chunk of n frames gives n * upsample - `lost`
samples). A chunk here decodes its new frames after up to `left_context` earlier ones and sends
every sample from where the previous chunk stopped to where its own output stops, so the stream
has no gap and its length is that of one decode of all the frames. Sample values match that one
decode up to the left context: attention and convolutions that would reach further back see the
context's start instead (Qwen's own `chunked_decode` makes the same trade with 25 frames).
"""

from dataclasses import dataclass, field

import numpy as np
import torch

SAMPLE_RATE = 24_000


@dataclass
class AudioStream:
    """One reply's frames and how far their audio has been sent."""

    frames: list[list[int]] = field(default_factory=list)  # [num_code_groups] codes per frame
    decoded: int = 0  # frames whose audio has been sent (up to the edge the next frame decides)
    sent: int = 0  # samples sent


class Vocoder:
    def __init__(self, code2wav: torch.nn.Module, first_chunk: int, chunk: int, left_context: int) -> None:
        self.code2wav = code2wav
        self.first_chunk, self.chunk, self.left_context = first_chunk, chunk, left_context
        self.samples_per_frame = int(code2wav.total_upsample)
        self.device = next(code2wav.parameters()).device

    def due(self, stream: AudioStream, final: bool) -> bool:
        """Whether a chunk should be decoded now: enough new frames, or the last of them."""
        pending = len(stream.frames) - stream.decoded
        return pending >= (self.first_chunk if stream.decoded == 0 else self.chunk) or (final and pending > 0)

    @torch.inference_mode()
    def decode(self, stream: AudioStream) -> np.ndarray:
        """The next samples (float32, mono, SAMPLE_RATE) from the frames not decoded yet."""
        start, end = stream.decoded, len(stream.frames)
        context = min(self.left_context, start)
        codes = torch.tensor(stream.frames[start - context : end], device=self.device).T[None]  # [1, groups, n]
        wav = self.code2wav(codes)[0, 0].float().cpu().numpy()
        first = (start - context) * self.samples_per_frame  # the sample the output begins at
        samples = wav[stream.sent - first :]
        stream.decoded, stream.sent = end, first + len(wav)
        return samples
