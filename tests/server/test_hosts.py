"""Which names the API and the page answer to, and which pages may call them (omni_local/server/hosts.py),
met from outside: `python -m omni_local serve` and `python app.py --ui-serves-api true` in
subprocesses, sent what a page in the user's own browser would send them after re-pointing its own
name at 127.0.0.1 (DNS rebinding), and what a proxy's users and this machine's own clients send.
"""

import socket

import httpx
import pytest

from omni_local.errors import SettingsError
from omni_local.server.hosts import ServedNames
from served_api import served_api
from served_app import served_app

PROXY_NAME = "chat.example.com"  # the name a reverse proxy in front of the app is reached by
FOREIGN = "evil.example"


@pytest.fixture(scope="module")
def api(demo_settings, demo_checkpoint, tmp_path_factory):
    with served_api(demo_settings, tmp_path_factory.mktemp("hosts_api"), "--allowed-hosts", PROXY_NAME) as served:
        yield served


@pytest.fixture(scope="module")
def page(demo_settings, demo_checkpoint, tmp_path_factory):
    with served_app(demo_settings, tmp_path_factory.mktemp("hosts_page"), "--ui-serves-api", "true",
                    "--allowed-hosts", PROXY_NAME) as served:
        yield served


# Each server's paths a page of another site would read: the API's, the page's own and Gradio's.
PATHS = [("api", "/v1/models"), ("page", "/"), ("page", "/gradio_api/info"), ("page", "/v1/models")]


def served(request, name: str) -> tuple[str, int]:
    """The base URL (no trailing slash) and port of the fixture `name`."""
    url = request.getfixturevalue(name).url.removesuffix("/").removesuffix("/v1")
    return url, int(url.rsplit(":", 1)[1])


def get(url: str, path: str, **headers: str) -> httpx.Response:
    return httpx.get(url + path, headers=headers)


@pytest.mark.parametrize(("server", "path"), PATHS)
@pytest.mark.parametrize("host", [f"{FOREIGN}:{{port}}", FOREIGN, "localhost.evil.example:{port}"])
def test_a_request_with_a_foreign_host_is_refused(request, server, path, host):
    url, port = served(request, server)
    answer = get(url, path, host=host.format(port=port), origin=f"http://{host.format(port=port)}")
    assert answer.status_code == 400
    assert f"'{host.format(port=port)}' is not a name of this server" in answer.json()["error"]["message"]
    assert "access-control-allow-origin" not in answer.headers


@pytest.mark.parametrize(("server", "path"), PATHS)
@pytest.mark.parametrize("host", ["127.0.0.1:{port}", "localhost:{port}", "[::1]:{port}", "LOCALHOST:{port}",
                                  PROXY_NAME, f"{PROXY_NAME}:443"])
def test_a_request_naming_this_server_or_a_name_of_allowed_hosts_is_answered(request, server, path, host):
    url, port = served(request, server)
    assert get(url, path, host=host.format(port=port)).status_code == 200


@pytest.mark.parametrize(("server", "path"), PATHS)
@pytest.mark.parametrize("origin", [f"http://{FOREIGN}", "null", "http://127.0.0.1:1", "http://localhost:{port}"])
def test_a_request_from_another_sites_page_is_refused_with_no_cors_grant(request, server, path, origin):
    url, port = served(request, server)
    origin = origin.format(port=port)
    answer = get(url, path, origin=origin)  # its Host, 127.0.0.1:PORT, is this server's: the Origin is not
    assert answer.status_code == 403 and f"'{origin}'" in answer.json()["error"]["message"]
    assert "access-control-allow-origin" not in answer.headers


@pytest.mark.parametrize(("server", "path"), PATHS)
def test_a_preflight_from_another_sites_page_gets_no_cors_grant(request, server, path):
    url, port = served(request, server)
    for host in (f"127.0.0.1:{port}", f"{FOREIGN}:{port}"):
        answer = httpx.options(url + path, headers={"host": host, "origin": f"http://{FOREIGN}",
                                                    "access-control-request-method": "POST"})
        assert answer.status_code in (400, 403) and "access-control-allow-origin" not in answer.headers


@pytest.mark.parametrize(("server", "path"), PATHS)
@pytest.mark.parametrize("origin", ["http://127.0.0.1:{port}", f"https://{PROXY_NAME}"])
def test_a_request_from_the_servers_own_page_or_the_proxys_is_answered(request, server, path, origin):
    url, port = served(request, server)
    assert get(url, path, origin=origin.format(port=port)).status_code == 200


# The names themselves -----------------------------------------------------------------------------


@pytest.mark.parametrize(("listen_host", "name", "answered"), [
    ("0.0.0.0", socket.gethostname().lower(), True), ("0.0.0.0", "192.168.1.5", True), ("::", "fe80::1", True),
    ("0.0.0.0", FOREIGN, False), ("192.168.1.5", "192.168.1.5", True), ("192.168.1.5", "10.0.0.1", False),
    ("192.168.1.5", "127.0.0.2", True), ("myhost.lan", "myhost.lan", True), ("127.0.0.1", "192.168.1.5", False),
    ("127.0.0.1", socket.gethostname().lower(), False),
])
def test_listening_on_every_address_answers_to_this_machines_names_and_any_address_else_to_its_own(
        listen_host, name, answered):
    assert ServedNames(listen_host, "").allows(name) is answered


@pytest.mark.parametrize("setting", ["https://chat.example.com", "chat.example.com:443", "chat.example.com/v1",
                                     "chat example.com"])
def test_allowed_hosts_takes_names_only_and_says_so(setting):
    with pytest.raises(SettingsError, match=f"allowed_hosts: '{setting}' is not a host name"):
        ServedNames("127.0.0.1", f"localhost, {setting}")
