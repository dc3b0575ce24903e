"""Clients that send a request slowly, or send much at once, as the API meets them: `python -m omni_local
serve` and the page's `/v1` in subprocesses, stalled with raw sockets (no HTTP client would stall).

A request is let in once its body has come; a body that does not come within `api_body_timeout_s`
is answered 408 and its connection closed, and headers that do not within `api_header_timeout_s`
have their connection closed. Request bodies held at once share `api_body_budget_bytes`.
"""

import contextlib
import http.client
import json
import socket
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest

from served_api import client, served_api
from served_app import served_app

TIMEOUT_S = 2  # the header and body timeouts of the servers that time clients out
CLOSE_MARGIN_S = 30  # how much later than its timeout a socket may be seen closed on a busy machine
STALLED = 40  # more than api_max_requests (32)
MAX_UPLOAD_BYTES = 100_000  # so a body may be 400,000 bytes
BODY_BUDGET_BYTES = 300_000
SLOW_FLAGS = ("--header-timeout-s", str(TIMEOUT_S), "--api-body-timeout-s", str(TIMEOUT_S))


@pytest.fixture(scope="module")
def impatient(demo_settings, demo_checkpoint, tmp_path_factory):
    """The API, timing slow clients out after TIMEOUT_S."""
    with served_api(demo_settings, tmp_path_factory.mktemp("impatient"), *SLOW_FLAGS) as served:
        yield served


@pytest.fixture(scope="module")
def frugal(demo_settings, demo_checkpoint, tmp_path_factory):
    """The API, holding at most BODY_BUDGET_BYTES of request bodies at once (with the default timeouts)."""
    with served_api(demo_settings, tmp_path_factory.mktemp("frugal"), "--max-upload-bytes", str(MAX_UPLOAD_BYTES),
                    "--api-body-budget-bytes", str(BODY_BUDGET_BYTES)) as served:
        yield served


@pytest.fixture(scope="module")
def impatient_page(demo_settings, demo_checkpoint, tmp_path_factory):
    """The page, serving the API beside it, timing slow clients out after TIMEOUT_S; its API's URL."""
    with served_app(demo_settings, tmp_path_factory.mktemp("impatient_page"), "--ui-serves-api", "true",
                    *SLOW_FLAGS) as page:
        yield page.url + "v1"


def test_forty_half_sent_requests_leave_the_api_answering_and_are_closed_after_the_body_timeout(impatient):
    _stalled_bodies_are_timed_out(impatient.url)


def test_forty_half_sent_requests_to_the_pages_api_leave_it_answering_and_are_closed_after_the_body_timeout(
        impatient_page):
    _stalled_bodies_are_timed_out(impatient_page)


@pytest.mark.parametrize("sent", [b"", b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 1000\r\n"],
                         ids=["nothing", "half the headers"])
@pytest.mark.parametrize("where", ["serve", "page"])
def test_a_connection_whose_headers_do_not_come_is_closed_after_the_header_timeout(request, where, sent):
    url = request.getfixturevalue("impatient").url if where == "serve" else request.getfixturevalue("impatient_page")
    with _connections(url, STALLED) as stalled:
        for connection in stalled:
            connection.sendall(sent)
        assert [m.id for m in client(url).models.list().data] == ["demo"]
        assert [_until_closed(c) for c in stalled] == [b""] * STALLED


def test_the_next_request_on_a_kept_alive_connection_has_the_header_timeout_too(impatient):
    with _connections(impatient.url, 1) as [connection]:
        connection.sendall(_request_head(impatient.url, "GET", "/v1/models"))
        first = http.client.HTTPResponse(connection)  # read to its end, the connection kept
        first.begin()
        assert first.status == 200 and json.loads(first.read())["data"][0]["id"] == "demo"
        connection.sendall(b"GET /v1/mod")  # and no more: uvicorn's keep-alive timer stops at the first byte
        assert _until_closed(connection) == b""


def test_a_body_past_the_budget_of_bodies_held_at_once_is_429_and_a_body_alone_is_let_in_past_it(frugal):
    url = frugal.url
    with _connections(url, 1) as [holding]:
        holding.sendall(_request_head(url, "POST", "/v1/chat/completions", 400_000) + b" " * 200_000)
        time.sleep(1)  # for the server to read what was sent: 200,000 bytes held (10,001 would do)
        refused = _post(url, 290_000)
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        error = refused.json()["error"]
        assert error["code"] == "rate_limit_exceeded" and "api_body_budget_bytes" in error["message"]
    alone = _post(url, 350_000)  # over the budget, under the body's own bound of 400,000
    assert alone.status_code == 200 and alone.json()["usage"]["completion_tokens"] == 1


def _stalled_bodies_are_timed_out(url: str) -> None:
    """STALLED requests whose headers say 1,000 bytes of body and that send one: a normal request is
    answered meanwhile, and each stalled one gets 408 and its connection closed."""
    with _connections(url, STALLED) as stalled:
        for connection in stalled:
            connection.sendall(_request_head(url, "POST", "/v1/chat/completions", 1000) + b"{")
        time.sleep(1)  # for the server to read every one of them
        answer = client(url).chat.completions.create(model="demo", messages=[{"role": "user", "content": "Hi"}],
                                                     max_tokens=1)
        assert answer.usage.completion_tokens == 1
        for connection in stalled:
            status, _, rest = _until_closed(connection).partition(b"\r\n")
            assert status == b"HTTP/1.1 408 Request Timeout" and b"api_body_timeout_s" in rest


def _post(url: str, size: int) -> httpx.Response:
    """A one-token chat completion whose body, padded with JSON's white space, is `size` bytes."""
    request = json.dumps({"model": "demo", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1})
    return httpx.post(f"{url}/chat/completions", content=request.ljust(size).encode(), timeout=60,
                      headers={"Content-Type": "application/json"})


@contextlib.contextmanager
def _connections(url: str, count: int) -> Iterator[list[socket.socket]]:
    address = urlsplit(url)
    connections = [socket.create_connection((address.hostname, address.port)) for _ in range(count)]
    try:
        yield connections
    finally:
        for connection in connections:
            connection.close()


def _request_head(url: str, method: str, path: str, length: int = 0) -> bytes:
    host = urlsplit(url).netloc
    return (f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def _until_closed(connection: socket.socket) -> bytes:
    """All the server sends on `connection` until it closes it."""
    connection.settimeout(TIMEOUT_S + CLOSE_MARGIN_S)
    received = b""
    try:
        while chunk := connection.recv(1 << 16):
            received += chunk
    except TimeoutError:
        pytest.fail(f"the server kept a connection open {TIMEOUT_S + CLOSE_MARGIN_S} s, having sent {received!r}")
    return received
