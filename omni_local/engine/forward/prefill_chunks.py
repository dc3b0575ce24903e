"""A prompt's tail as the prefill computes it, and its cut into chunks.

While another reply is decoding or speaking, a prefill runs in chunks of a fixed size, one per
engine turn, so a long prompt holds up those replies one chunk at a time; with nobody to hold up,
the rest of the tail is one forward (engine.py says why). The chunks' boundaries are fixed by
position in the prompt, multiples of the chunk size, whatever the prefix cache supplied: a tail from
cached row 700, in chunks of 512, is computed as rows 700 to 1024, then 1024 to 1536, and so on.
Each chunk attends to the rows before it as a tail on a cached prefix does.

The tail is prepared once (embeddings, every medium encoded, positions of the whole prompt), and
each chunk is a slice of it: a medium whose tokens straddle a boundary is encoded once, its rows and
DeepStack features split between the chunks.
"""

from dataclasses import dataclass, replace

import torch

from omni_local.protocol.events import MediaCounts


@dataclass(frozen=True)
class PreparedPrompt:
    """What a prefill needs: the embeddings and 3D positions of the prompt's tokens from `start` on
    (those before are in the KV already), tensors on the model's device unless said."""

    start: int
    embeds: torch.Tensor  # [1, L - start, hidden]
    positions: torch.Tensor  # [3, 1, L - start]
    rope_delta: int  # position of token t after the prompt is t + rope_delta
    visual_mask: torch.Tensor | None  # [1, L - start], where deepstack features are added
    deepstack: list[torch.Tensor] | None  # one [visual tokens, hidden] per deepstack layer
    ids: torch.Tensor  # [1, L - start] the tail's token ids, on the host (the Talker rows' media mask)
    media: MediaCounts
    # [L - start + 1] on the host: how many visual tokens come before each row of the tail (and
    # after its last), so a chunk finds its DeepStack rows without asking the device.
    visual_before: torch.Tensor | None = None

    @property
    def end(self) -> int:
        """The prompt's length: the row after the tail's last."""
        return self.start + self.embeds.shape[1]

    def rows(self, begin: int, end: int) -> "PreparedPrompt":
        """The part of the tail from prompt row `begin` to `end`, as a tail of its own after `begin`
        rows: its embeddings, positions and ids, and the DeepStack rows of its visual tokens."""
        assert self.start <= begin < end <= self.end, f"rows {begin} to {end} are outside the tail"
        if (begin, end) == (self.start, self.end):
            return self
        cut = slice(begin - self.start, end - self.start)
        visual_mask, deepstack, visual_before = None, None, None
        if self.deepstack is not None:
            first, last = (int(self.visual_before[i]) for i in (cut.start, cut.stop))
            if last > first:  # else no visual token in the part: nothing of DeepStack to add
                visual_mask = self.visual_mask[:, cut]
                deepstack = [level[first:last] for level in self.deepstack]
                visual_before = self.visual_before[cut.start : cut.stop + 1] - first
        return replace(self, start=begin, embeds=self.embeds[:, cut], positions=self.positions[:, :, cut],
                       visual_mask=visual_mask, deepstack=deepstack, ids=self.ids[:, cut], visual_before=visual_before)


def chunk_end(done: int, prompt_end: int, chunk_tokens: int) -> int:
    """Where the chunk that starts at row `done` ends: the next multiple of `chunk_tokens`, or the
    prompt's end if that comes first."""
    return min((done // chunk_tokens + 1) * chunk_tokens, prompt_end)

