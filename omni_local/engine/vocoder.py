"""Code2Wav in small causal chunks, so audio streams while the Talker is still making codes.

Code2Wav is causal except at its right edge: the last samples a chunk of n frames could give
depend on frame n + 1, so the model crops them (a chunk of n frames gives n * upsample - `lost`
samples). A chunk here decodes its new frames after up to `left_context` earlier ones and sends
every sample from where the previous chunk stopped to where its own output stops, so the stream
has no gap and its length is that of one decode of all the frames. Sample values match that one
decode up to the left context: attention and convolutions that would reach further back see the
context's start instead (Qwen's own `chunked_decode` makes the same trade with 25 frames).

The first chunk is small, for latency; each next one twice the one before, up to `chunk` frames.
While a chunk plays, the next is made: with twice the frames it is ready in time while speech is
made at least twice as fast as it plays (real-time factor 0.5), and the player never waits between
chunks. Equal chunks after a small first one would leave a gap whenever making the second takes
longer than the first takes to play (seen in the browser: a 2-frame chunk, then a 10-frame one).
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
    chunks: int = 0  # chunks sent


class Vocoder:
    def __init__(self, code2wav: torch.nn.Module, first_chunk: int, chunk: int, left_context: int) -> None:
        self.code2wav = code2wav
        self.first_chunk, self.chunk, self.left_context = first_chunk, chunk, left_context
        self.samples_per_frame = int(code2wav.total_upsample)
        self.device = next(code2wav.parameters()).device

    def due(self, stream: AudioStream, final: bool) -> bool:
        """Whether a chunk should be decoded now: enough new frames, or the last of them."""
        pending = len(stream.frames) - stream.decoded
        return pending >= self.chunk_frames(stream) or (final and pending > 0)

    def chunk_frames(self, stream: AudioStream) -> int:
        """Frames in the stream's next chunk: the first chunk's, doubled with each chunk sent."""
        return min(self.chunk, self.first_chunk << stream.chunks)

    @torch.inference_mode()
    def decode(self, stream: AudioStream) -> np.ndarray:
        """The next samples (float32, mono, SAMPLE_RATE) from the frames not decoded yet."""
        start, end = stream.decoded, len(stream.frames)
        context = min(self.left_context, start)
        codes = torch.tensor(stream.frames[start - context : end], device=self.device).T[None]  # [1, groups, n]
        wav = self.code2wav(codes)[0, 0].float().cpu().numpy()
        first = (start - context) * self.samples_per_frame  # the sample the output begins at
        samples = wav[stream.sent - first :]
        stream.decoded, stream.sent, stream.chunks = end, first + len(wav), stream.chunks + 1
        return samples
