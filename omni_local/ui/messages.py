"""A chat message's content as Gradio holds it, in every form it comes in: a string, a file (a
dict with a path, a typed block, a tuple), or a list of such blocks, as made here or as the page
sends it back. The chat, its store and voice mode all read messages through these."""

from pathlib import Path
from typing import Any


def blocks(message: dict[str, Any]) -> list[Any]:
    """The message's content as a list of blocks: Gradio keeps a lone block without the list."""
    content = message.get("content")
    return content if isinstance(content, list) else [content]


def block_text(block: Any) -> str | None:
    """The text of a text block (a string, or a typed text block), None for any other block."""
    if isinstance(block, str):
        return block
    if isinstance(block, dict) and block.get("type") == "text":
        return block.get("text", "")
    return None


def file_path(block: Any) -> str | None:
    """The path of a file block, None for any other block."""
    if isinstance(block, dict):
        if block.get("type") == "file":
            block = block.get("file", block)
        return block.get("path")
    if isinstance(block, tuple) and block:
        return block[0]
    return None


def looks(message: dict[str, Any]) -> tuple[Any, ...]:
    """What a message shows, in either form a chat holds it (as made here, or as the page sends it
    back): its role, its files by name (a copy Gradio serves keeps the name), its texts without their
    white space (the page's are dedented: inspect.cleandoc), its title."""
    shown = []
    for block in blocks(message):
        path = file_path(block)
        shown.append(Path(path).name if path else "".join((block_text(block) or "").split()))
    return message["role"], shown, (message.get("metadata") or {}).get("title")
