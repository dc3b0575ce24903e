"""The types of `Session.send`'s media and tools arguments, checked before anything is read: a wrong one is a
`RequestError` naming the argument and the item (`images[0]: expected a path, bytes or PIL image,
got int`), not a `TypeError` from deep inside a decoder."""

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from omni_local.errors import RequestError
from omni_local.media.video import Video
from omni_local.protocol.functions import Tool


@dataclass(frozen=True)
class Accepted:
    """What an argument's items may be, and how a message says it of one item and of many."""

    types: tuple[type, ...]
    one: str
    many: str


IMAGES = Accepted((str, Path, bytes, Image.Image), "a path, bytes or PIL image", "paths, bytes or PIL images")
AUDIO = Accepted((str, Path, bytes, np.ndarray), "a path, bytes or numpy array", "paths, bytes or numpy arrays")
VIDEOS = Accepted((str, Path, bytes, Video), "a path, bytes or Video", "paths, bytes or Videos")
TOOLS = Accepted((Tool,), "a Tool", "Tools")


def listed(argument: str, value: object, accepted: Accepted) -> list:
    """`value`'s items, each of an accepted type. A single item where a list belongs (`images="a.jpg"`,
    which would be iterated as characters, or `audio=samples`) is refused, not guessed at."""
    if isinstance(value, accepted.types) or not isinstance(value, Iterable):
        raise RequestError(f"{argument}: expected a list of {accepted.many}, got {type(value).__name__}")
    items = list(value)
    for index, item in enumerate(items):
        checked(f"{argument}[{index}]", item, accepted)
    return items


def checked(argument: str, item: object, accepted: Accepted) -> object:
    """`item`, if of an accepted type."""
    if not isinstance(item, accepted.types):
        raise RequestError(f"{argument}: expected {accepted.one}, got {type(item).__name__}")
    return item
