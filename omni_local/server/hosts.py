"""Which names the page and the API answer to, and which web pages may call them: each request's
`Host` and `Origin` checked before anything else reads it (`HostCheck`, an ASGI middleware).

A server on 127.0.0.1 with no key is still in reach of a web page in the user's own browser: the
page's site points its own name at 127.0.0.1 (DNS rebinding), and the browser then sends requests
with `Host: evil.example:PORT` and lets the page read the answers. So the Host must name this
server: a loopback name or address, the address it listens on, a name of `allowed_hosts` (a
reverse proxy's), and, listening on every address (0.0.0.0, ::), this machine's name, or any IP
address (a name can be pointed anywhere, an address cannot; the machine's addresses cannot all be
known). Anything else is 400.

A browser says which site's page sends a request (`Origin`); only the server's own site (the
Origin names what the Host names) and the names of `allowed_hosts` may: another's page gets 403,
before any CORS handling could grant it the answer.
"""

import ipaddress
import re
import socket
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocketClose

from omni_local.access import is_loopback
from omni_local.errors import SettingsError
from omni_local.server.errors import ApiError

EVERY_ADDRESS = frozenset({"0.0.0.0", "::"})
DEFAULT_PORTS = {"http": 80, "ws": 80, "https": 443, "wss": 443}
Site = tuple[str, int | None]  # a host name, lower case, brackets off, and its port (None: not known)
HOST_NAME = re.compile(r"[a-z0-9]([a-z0-9.-]*[a-z0-9])?")


class ServedNames:
    """The names a server listening on `listen_host` answers to, with `allowed_hosts` (comma-separated)."""

    def __init__(self, listen_host: str, allowed_hosts: str) -> None:
        self.listen_host = listen_host.lower().strip("[]")
        self.allowed = allowed_names(allowed_hosts)
        self.own = {self.listen_host}
        if self.listen_host in EVERY_ADDRESS:
            self.own |= machine_names()

    def allows(self, name: str) -> bool:
        if is_loopback(name) or name in self.own or name in self.allowed:
            return True
        address = ip_address(name)
        return address is not None and (self.listen_host in EVERY_ADDRESS or address == ip_address(self.listen_host))

    def refusal(self, headers: Headers, scheme: str) -> ApiError | None:
        """Why a request with these headers, sent over `scheme`, is refused; None if it is not."""
        host = headers.get("host", "")
        site = parse_site(f"//{host}", scheme)
        if site is None or not self.allows(site[0]):
            return ApiError(400, f"the Host '{host}' is not a name of this server: a proxy's name is added with "
                            "the setting allowed_hosts", "host_not_allowed")
        origin = headers.get("origin")
        if origin is None or self._welcomes(origin, site):
            return None
        return ApiError(403, f"requests from the pages of '{origin}' are refused: this server answers its own "
                        "pages (and those of the names of allowed_hosts)", "origin_not_allowed")

    def _welcomes(self, origin: str, host: Site) -> bool:
        site = parse_site(origin)
        if site is None:
            return False  # "null" (a sandboxed or local file's page), or not a URL
        return site[0] in self.allowed or site == host


class HostCheck:
    """Refuses a request whose Host is not one of `names`, or whose Origin is another site's."""

    def __init__(self, app: ASGIApp, names: ServedNames) -> None:
        self.app, self.names = app, names

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        refusal = self.names.refusal(Headers(scope=scope), scope["scheme"])
        if refusal is None:
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await WebSocketClose(code=1008)(scope, receive, send)  # before it is accepted: the client gets 403
        else:
            await refusal.response()(scope, receive, send)


def allowed_names(setting: str) -> frozenset[str]:
    """The names of `allowed_hosts`: host names or addresses, without scheme, port or path."""
    names = [name.strip().lower() for name in setting.split(",") if name.strip()]
    for name in names:
        if not HOST_NAME.fullmatch(name) and ip_address(name.strip("[]")) is None:
            raise SettingsError(f"allowed_hosts: '{name}' is not a host name (give names such as "
                                "'chat.example.com', comma-separated, without scheme or port)")
    return frozenset(name.strip("[]") for name in names)


def machine_names() -> set[str]:
    """The names this machine is known by on its network, as far as it knows them itself."""
    name = socket.gethostname().lower()
    return {name, f"{name}.local", socket.getfqdn().lower()}  # `.local`: its multicast DNS name


def parse_site(url: str, scheme: str = "") -> Site | None:
    """The host name and port of a URL ("//host:port" for a Host header sent over `scheme`), the port
    its scheme's default where it gives none; None if it names no host."""
    try:
        parts = urlsplit(url, scheme=scheme)
        return (parts.hostname, parts.port or DEFAULT_PORTS.get(parts.scheme)) if parts.hostname else None
    except ValueError:  # a port that is not a number
        return None


def ip_address(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None
