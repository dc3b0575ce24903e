"""The check every text a request brings passes before it reaches a tokenizer."""

from omni_local.errors import RequestError


def check_text(text: str, holder: str) -> None:
    """Refuse what is not text a tokenizer takes, such as a lone surrogate: a JSON "\\ud800" or bytes
    that are not UTF-8 (decoded with surrogateescape, as Python does a command line's) leave one."""
    if not isinstance(text, str):
        raise RequestError(f"{holder} must be text, not {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise RequestError(f"{holder} holds text that is not valid Unicode (invalid UTF-8 or a lone surrogate "
                           f"at character {error.start + 1})") from None
