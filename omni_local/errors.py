"""Errors a user can act on.

Anything raised as an `OmniLocalError` is shown to the user as its message alone (one line in the
CLI, a chat message in the UI), never as a traceback; the session and the engine keep serving.
"""


class OmniLocalError(Exception):
    """A problem with the user's input, settings or checkpoint, explained in its message."""


class SettingsError(OmniLocalError):
    """A settings file or command-line override that is unknown or of the wrong type."""


class CheckpointError(OmniLocalError):
    """A model directory that is missing, incomplete or unreadable."""


class MediaError(OmniLocalError):
    """An image or audio file that cannot be read, is of the wrong type, or is over a limit."""


class UploadTooLarge(MediaError):
    """A file over the upload size limit (`max_upload_bytes`): the API answers it with 413, not 400."""


class RequestError(OmniLocalError):
    """A request the engine cannot serve: too long a prompt, out of memory, bad sampling values."""
