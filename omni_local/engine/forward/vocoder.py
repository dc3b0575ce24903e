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

On a GPU a chunk replays a CUDA graph (ChunkGraphs), captured at start-up for each length a full
chunk has (context included: 2, 6, 14, 24, 34 and 35 frames with the default settings). A last,
shorter chunk is padded on the right to the next length; causality makes its samples those of an
unpadded decode, and the padding frames' samples are cut.
"""

from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch

from omni_local.engine.forward.cuda_graphs import capture_graph
from omni_local.engine.memory.host_copies import to_device


@dataclass
class AudioStream:
    """One reply's frames and how far their audio has been sent."""

    frames: list[list[int]] = field(default_factory=list)  # [num_code_groups] codes per frame
    decoded: int = 0  # frames whose audio has been sent (up to the edge the next frame decides)
    sent: int = 0  # samples sent
    chunks: int = 0  # chunks sent


class Vocoder:
    def __init__(
        self, code2wav: torch.nn.Module, first_chunk: int, chunk: int, left_context: int, cuda_graphs: bool = False
    ) -> None:
        self.code2wav = code2wav
        self.first_chunk, self.chunk, self.left_context = first_chunk, chunk, left_context
        self.samples_per_frame = int(code2wav.total_upsample)
        self.device = next(code2wav.parameters()).device
        # Eager, a chunk costs about 20 ms on an H200 whether 4 or 25 frames: kernel launches, not
        # compute, so a graph cuts the first audio's latency and every chunk's cost.
        self._capture = cuda_graphs and self.device.type == "cuda"
        self.graphs: ChunkGraphs | None = None  # set once captured, by warm_up

    @torch.inference_mode()
    def warm_up(self, frame: list[int]) -> None:
        """The graphs, captured, then a first chunk of `frame` repeated (replaying its graph once),
        so the first spoken reply pays no first-use costs."""
        if self._capture:
            self.graphs = ChunkGraphs(self.code2wav, self.chunk_lengths())
        self.decode(AudioStream(frames=[frame] * self.first_chunk))

    def due(self, stream: AudioStream, final: bool) -> bool:
        """Whether a chunk should be decoded now: enough new frames, or the last of them."""
        pending = len(stream.frames) - stream.decoded
        return pending >= self.chunk_frames(stream) or (final and pending > 0)

    def chunk_frames(self, stream: AudioStream) -> int:
        """Frames in the stream's next chunk: the first chunk's, doubled with each chunk sent."""
        return min(self.chunk, self.first_chunk << stream.chunks)

    def chunk_lengths(self) -> list[int]:
        """Frames Code2Wav reads for each full chunk of a long stream, its left context included,
        until they stop growing at `left_context + chunk`. A stream's last chunk may be shorter."""
        lengths, stream = [], AudioStream()
        while not lengths or lengths[-1] < self.left_context + self.chunk:
            new = self.chunk_frames(stream)
            lengths.append(min(self.left_context, stream.decoded) + new)
            stream.decoded, stream.chunks = stream.decoded + new, stream.chunks + 1
        return sorted(set(lengths))

    @torch.inference_mode()
    def decode(self, stream: AudioStream) -> np.ndarray:
        """The next samples (float32, mono, SPEECH_SAMPLE_RATE) from the frames not decoded yet."""
        start, end = stream.decoded, len(stream.frames)
        context = min(self.left_context, start)
        # Through pinned memory: a copy from pageable memory would first wait for all queued work.
        codes = to_device(torch.tensor(stream.frames[start - context : end]), self.device).T[None]  # [1, groups, n]
        wav = self.graphs.replay(codes) if self.graphs is not None else self.code2wav(codes)
        wav = wav[0, 0].float().cpu().numpy()
        first = (start - context) * self.samples_per_frame  # the sample the output begins at
        samples = wav[stream.sent - first :]
        stream.decoded, stream.sent, stream.chunks = end, first + len(wav), stream.chunks + 1
        return samples


class ChunkGraphs:
    """Code2Wav captured as a CUDA graph for chunks of each of `lengths` frames, over static codes,
    and replayed from the smallest length that holds a chunk."""

    def __init__(self, code2wav: torch.nn.Module, lengths: list[int]) -> None:
        self.lengths = sorted(lengths)
        self.samples_per_frame = int(code2wav.total_upsample)
        groups, device = code2wav.config.num_quantizers, next(code2wav.parameters()).device
        # Static [1, groups, length] codes per graph. Frames past a chunk's own keep zeros or an
        # earlier chunk's codes: valid code ids, whose samples are cut.
        self._codes = {n: torch.zeros(1, groups, n, dtype=torch.long, device=device) for n in self.lengths}
        pool = torch.cuda.graph_pool_handle()
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # length -> graph, its [1, 1, samples]
        for n in reversed(self.lengths):  # largest first: the smaller ones reuse its pool memory
            self._graphs[n] = capture_graph(partial(code2wav, self._codes[n]), pool)

    def replay(self, codes: torch.Tensor) -> torch.Tensor:
        """What `code2wav(codes)` returns for codes [1, groups, n]: [1, 1, n * upsample - lost]."""
        n = codes.shape[-1]
        length = next((length for length in self.lengths if n <= length), None)
        if length is None:
            raise ValueError(f"Code2Wav graphs decode chunks of up to {self.lengths[-1]} frames, not {n}")
        self._codes[length][..., :n].copy_(codes)
        graph, wav = self._graphs[length]
        graph.replay()
        # Causal but for the last frame's crop: the first n frames' samples are an unpadded decode's.
        return wav[..., : wav.shape[-1] - (length - n) * self.samples_per_frame].clone()
