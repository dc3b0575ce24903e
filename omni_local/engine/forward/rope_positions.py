"""A prompt's 3D rotary positions (M-RoPE), the ones transformers' `get_rope_index` gives, worked out
from the prompt's list of media instead of by scanning its tokens.

Text and the markers around media count up one by one on all three axes. An image's or a video's
tokens take (time, row, column) positions from the position where it starts; a clip's count up like
text. After a medium, counting goes on from one past the largest position of the last piece
transformers placed. A video with its sound interleaves the two by time: transformers merges them
one token at a time in a Python loop (21 ms on our 2-core CPU for the demo model's 10 s video, paid
on every turn of a chat holding it); here that merge is one stable sort, which gives the same order
because both runs are sorted and a frame goes first on a tie. The arithmetic is transformers' own,
in float32, so the positions are the same bits (tests compare them on every kind of prompt).
"""

import torch

from omni_local.engine.prompt.builder import MediaItem, Prompt


def rope_positions(prompt: Prompt, merge: int, per_second: int) -> tuple[torch.Tensor, int]:
    """Positions [3, 1, L] float32 of `prompt`'s tokens, and the delta of later tokens (token t after
    the prompt is at t + delta). `merge`: the vision encoder's spatial merge; `per_second`: position
    steps per second of video."""
    pieces: list[torch.Tensor] = []
    start = torch.tensor(0.0)  # the position the next token takes
    cursor = 0
    for item in prompt.media:
        pieces.append(_counting(item.start - cursor, start))
        start = start + (item.start - cursor)
        block, last_piece = _media_positions(item, start, merge, per_second)
        pieces.append(block)
        start = last_piece.max() + 1
        cursor = item.end
    pieces.append(_counting(prompt.num_tokens - cursor, start))
    positions = torch.cat(pieces, dim=1)
    return positions[:, None], int(positions.max() + 1 - prompt.num_tokens)


def _counting(count: int, start: torch.Tensor) -> torch.Tensor:
    return torch.arange(count).expand(3, -1) + start


def _media_positions(item: MediaItem, start: torch.Tensor, merge: int,
                     per_second: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`item`'s positions [3, length] from `start`, and the last piece of them transformers places
    (the one the next position counts on from)."""
    if item.grid is None:  # a clip
        block = _counting(item.length, start)
        return block, block
    seconds = torch.tensor(item.seconds_per_grid if item.is_video else 1, dtype=torch.float32)
    vision = _grid_positions(item.grid, seconds, merge, per_second) + start
    if not item.has_audio:
        return vision, vision
    return _interleaved(vision, _counting(item.track_tokens, start))


def _grid_positions(grid: tuple[int, int, int], seconds: torch.Tensor, merge: int, per_second: int) -> torch.Tensor:
    """(time, row, column) [3, t * h * w / merge²] of a grid of patches, frame by frame, row by row."""
    frames, rows, columns = grid[0], grid[1] // merge, grid[2] // merge
    times = (torch.arange(frames) * seconds * per_second).float()
    return torch.stack([times.view(-1, 1).expand(-1, rows * columns).flatten(),
                        torch.arange(rows).view(1, -1, 1).expand(frames, -1, columns).flatten().float(),
                        torch.arange(columns).view(1, 1, -1).expand(frames, rows, -1).flatten().float()])


def _interleaved(frames: torch.Tensor, sound: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A video's frame and sound positions merged by time (a frame first on a tie), and the run of
    one kind the merge ends with: transformers places it as one last piece."""
    both = torch.cat([frames, sound.float()], dim=1)
    order = torch.sort(both[0], stable=True).indices
    merged = both[:, order]
    is_sound = order >= frames.shape[1]
    other_kind = (is_sound != is_sound[-1]).nonzero()
    tail_start = int(other_kind[-1]) + 1 if len(other_kind) else 0
    return merged, merged[:, tail_start:]
