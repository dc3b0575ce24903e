"""Content digests of media, by which the encoder cache and a prompt's token keys know them.

A medium is keyed by what the model sees of it: an image's RGB pixels after orientation and mode
conversion (with its size), a clip's 16 kHz samples, a video's sampled frames with their rate and
its sound track. The same picture under another file name or in
another lossless format has the same digest. BLAKE3 gives a full 256-bit cryptographic digest at
several GB/s on one core, so keying a 1200x1600 image costs about a millisecond of hashing.
"""

import blake3
import numpy as np
from PIL import Image

from omni_local.media.video import Video

_IMAGE, _AUDIO, _VIDEO = b"image/rgb8\0", b"audio/f32-16k\0", b"video/rgb8\0"


def media_digest(part: Image.Image | np.ndarray | Video) -> bytes:
    if isinstance(part, Image.Image):
        assert part.mode == "RGB", "media are decoded to RGB before they are keyed"
        hasher = blake3.blake3(_IMAGE + f"{part.width}x{part.height}\0".encode())
        hasher.update(part.tobytes())
    elif isinstance(part, Video):
        # The frames as sampled and their rate (which places them in time), then the sound track.
        frames = np.ascontiguousarray(part.frames, dtype=np.uint8)
        hasher = blake3.blake3(_VIDEO + f"{'x'.join(map(str, frames.shape))}@{part.fps!r}\0".encode())
        hasher.update(memoryview(frames).cast("B"))
        hasher.update(media_digest(part.audio) if part.audio is not None else b"silent")
    else:
        samples = np.ascontiguousarray(part, dtype=np.float32)
        hasher = blake3.blake3(_AUDIO + f"{samples.size}\0".encode())
        hasher.update(memoryview(samples).cast("B"))
    return hasher.digest()
