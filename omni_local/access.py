"""Who may reach what this machine serves, and who is who: the chat page and the API listen on
127.0.0.1 by default; beyond it only with secrets kept in a private file (mode 0600): the page's
credentials (ui/access.py), the API's keys (here). The page's credentials do not open the API: a
client of the API sends a key, `Authorization: Bearer KEY`.

Each person is a principal: the holder of one API key, or one user of the page (each logged in by
name); with no keys and no logins there is one, the local user. Nothing one principal sent is shared
with another: not the prefix cache's KV nor its `cached_tokens`, not the encoder cache's outputs, not
the page's uploads. One principal's chats do share (a system prompt computed once).

A client that sends OpenAI's `prompt_cache_key` divides its key's caches further: its requests share
only with those that send the same (`within`). A page on the remote backend sends one for each of its
users, so that they share nothing at the server either, though all of them come with one key.

The key file holds one key a line, `KEY` or `NAME: KEY` (a colon and a space: a key may hold colons);
blank lines and lines that begin with `#` are skipped. A key without a name is named by its order.
"""

import hmac
import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path

import blake3

from omni_local.errors import SettingsError
from omni_local.settings import Settings


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def read_private_text(path: Path, setting: str) -> str:
    """The text of the file setting `setting` names, which must be closed to other users: it holds
    secrets."""
    try:
        mode = path.stat().st_mode
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise SettingsError(f"{setting} '{path}' cannot be read: {error.strerror}") from None
    if mode & 0o077:
        raise SettingsError(f"{setting} '{path}' is readable by others: make it private (chmod 600)")
    return text


LOCAL_USER = "local user"  # the principal where there are no keys and no logins
_NAMED_KEY = re.compile(r"([^\s:]+):\s+(\S+)")  # NAME: KEY


def principal_salt(principal: str) -> bytes:
    """What a cache key of `principal`'s begins with: nobody else's key can equal it."""
    return blake3.blake3(b"omni_local principal\0" + principal.encode("utf-8", "surrogatepass")).digest()


def api_principal(holder: str) -> str:
    """The principal of the holder of an API key (named in the key file)."""
    return f"api key {holder}"


def within(principal: str, cache_key: str | None) -> str:
    """The part of `principal`'s caches a request's `prompt_cache_key` names (OpenAI's field: which
    requests share a cache), a principal of its own; `principal` itself without one. A client can
    only divide its own caches: the part of another's is not its to name."""
    return principal if cache_key is None else f"{principal} / cache key {cache_key}"


def cache_key_of(principal: str) -> str:
    """The `prompt_cache_key` a remote backend sends for `principal` (a user of its page): a digest,
    so the server is not told the name."""
    return blake3.blake3(principal_salt(principal)).hexdigest()


def page_principal(user: str | None) -> str:
    """The principal of a user of the page: its login's name, or the local user without logins."""
    return LOCAL_USER if user is None else f"page user {user}"


@dataclass(frozen=True)
class ApiKeys:
    """The keys API clients may send, each naming its holder."""

    holders: dict[str, str]  # key -> its holder's name

    def holder(self, given: str) -> str | None:
        """Whose key `given` is; None if nobody's. Every key is compared, each in time that does not
        tell how much of it `given` got right."""
        found = None
        for key, name in self.holders.items():
            if hmac.compare_digest(given.encode(), key.encode()):
                found = name
        return found


def api_keys(settings: Settings, host_setting: str) -> ApiKeys | None:
    """The keys API clients must send one of, from `api_key_file`; None (no key asked) is allowed
    only on loopback. `host_setting` names the address the API listens on: `api_host` for `serve`,
    `ui_host` for the API beside the page."""
    host = getattr(settings, host_setting)
    if not settings.api_key_file:
        if not is_loopback(host):
            raise SettingsError(
                f"serving the API beyond this machine ({host_setting} = '{host}') needs a key: set api_key_file "
                "to a private file (chmod 600) holding it")
        return None
    path = Path(settings.api_key_file).expanduser()
    return read_api_keys(read_private_text(path, "api_key_file"), f"api_key_file '{path}'")


def read_api_keys(text: str, source: str) -> ApiKeys:
    """The keys of a key file's `text`; a line that is neither `KEY` nor `NAME: KEY`, a key or a name
    given twice, or no key at all is refused, by line number (a line holds a secret: never shown)."""
    holders: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        named = _NAMED_KEY.fullmatch(line)
        if named is None and any(c.isspace() for c in line):
            raise SettingsError(f"{source}: line {number} must be one key (a word without spaces) or 'NAME: KEY'")
        name, key = named.groups() if named else (f"{len(holders) + 1}", line)
        if key in holders:
            raise SettingsError(f"{source}: line {number} repeats a key: give each person a key of their own")
        if name in holders.values():
            raise SettingsError(f"{source}: line {number} repeats the name '{name}'")
        holders[key] = name
    if not holders:
        raise SettingsError(f"{source} must hold a key: one a line, 'KEY' or 'NAME: KEY'")
    return ApiKeys(holders)
