"""An idle client connection outlives the client's own pool (KVGATE_HTTP_KEEPALIVE_S, 75 s): the
openai client's httpx keeps one 5 s, and with uvicorn's default of 5 s on the server too, a request
sent on a connection the server was just closing failed with a read error (the soak saw one in
43,117). A real gateway process, a raw socket: after 6 s idle the same connection still answers."""
from __future__ import annotations

import socket
import time

import pytest

from tests.integration.test_faults import Cluster

REQUEST = b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: keep-alive\r\n\r\n"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model_dir):
    c = Cluster(tmp_path_factory.mktemp("keepalive"), tiny_model_dir)
    yield c
    c.close()


def _exchange(sock: socket.socket) -> bytes:
    """The whole response (head and its content-length of body, so none is left for the next
    exchange to read); what came before the server closed the connection, if it did."""
    data = b""
    try:
        sock.sendall(REQUEST)
        while not _complete(data):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    except ConnectionError:  # reset: the server had closed it
        pass
    return data


def _complete(data: bytes) -> bool:
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        return False
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    return len(body) >= length


@pytest.mark.parametrize("keepalive, idle, answers", [(None, 6.0, True), ("2", 3.5, False)])
def test_an_idle_connection_lives_as_long_as_the_setting_says(cluster, keepalive, idle, answers):
    proc = cluster.start_gateway(**({"KVGATE_HTTP_KEEPALIVE_S": keepalive} if keepalive else {}))
    try:
        host, port = cluster.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            assert _exchange(sock).startswith(b"HTTP/1.1 200")
            time.sleep(idle)
            second = _exchange(sock)
        assert second.startswith(b"HTTP/1.1 200") is answers, second[:80]
    finally:
        proc.terminate()
        proc.wait(30)
