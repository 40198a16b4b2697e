"""A client that opens a large stream and stops reading, against the whole stack (`kvgate up`, paged
engine): the gateway keeps at most KVGATE_MAX_UNREAD_REPLIES of its replies, then ends the stream
with client_not_reading (the error event is there when the client reads on) and its worker stops
generating it; a client that reads is served in full meanwhile. One that reads nothing at all for
KVGATE_CLIENT_WRITE_TIMEOUT_S is let go: the connection closed, the request cancelled. And one that
sends its request slowly: a head not whole within KVGATE_CLIENT_READ_TIMEOUT_S closes the connection,
a body that stops coming is a 408, while a kept-alive connection may idle between requests. A head
longer than KVGATE_MAX_HEAD_BYTES is a 431 and the connection closed: nothing of it is kept."""
from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from tests.conftest import start_stack, stop_stack
from tests.integration.test_faults import _wait

BOUND = 256
WRITE_TIMEOUT_S = 5
READ_TIMEOUT_S = 2
HEAD_BYTES = 8192
BIG = {"model": "demo", "prompt": "hi", "max_tokens": 1500, "n": 16, "logprobs": 20,
       "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    s = start_stack(tiny_model_dir, tmp_path_factory.mktemp("slow-client"), "paged",
                    extra_env={"KVGATE_MAX_UNREAD_REPLIES": str(BOUND),
                               "KVGATE_CLIENT_WRITE_TIMEOUT_S": str(WRITE_TIMEOUT_S),
                               "KVGATE_CLIENT_READ_TIMEOUT_S": str(READ_TIMEOUT_S),
                               "KVGATE_MAX_HEAD_BYTES": str(HEAD_BYTES)})
    yield s
    stop_stack(s.proc)


def _unread_stream(stack, body: dict) -> socket.socket:
    """A streamed request on a socket whose client does not read (a small receive window)."""
    host, port = stack.url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    raw = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: kvgate\r\nAuthorization: Bearer "
                 + stack.key.encode() + b"\r\nContent-Type: application/json\r\nContent-Length: "
                 + str(len(raw)).encode() + b"\r\n\r\n" + raw)
    return sock


def _read_all(sock: socket.socket, timeout: float = 60) -> tuple[bytes, bool]:
    """What the socket holds until the response's end, and whether it ended (else it closed)."""
    sock.settimeout(timeout)
    chunks = []
    while not chunks or not chunks[-1].endswith(b"0\r\n\r\n"):  # the chunked body's end
        chunk = sock.recv(1 << 16)
        if not chunk:
            return b"".join(chunks), False
        chunks.append(chunk)
    return b"".join(chunks), True


def _until_logged(path, text: str, timeout: float = 120, since: int = 0) -> None:
    """Until the log says `text` after its first `since` characters."""
    deadline = time.monotonic() + timeout
    while text not in path.read_text()[since:]:
        assert time.monotonic() < deadline, f"{path.name} never said {text!r}"
        time.sleep(0.2)


def test_a_stream_nobody_reads_ends_with_client_not_reading(stack):
    sock = _unread_stream(stack, BIG)
    _until_logged(stack.state / "gateway.log", "replies unread")
    # meanwhile another client, reading, is served in full
    normal = httpx.post(f"{stack.url}/v1/completions", timeout=60,
                        headers={"Authorization": f"Bearer {stack.key}"},
                        json={"model": "demo", "prompt": "hi", "max_tokens": 8, "ignore_eos": True})
    assert normal.status_code == 200 and normal.json()["usage"]["completion_tokens"] == 8
    body, ended = _read_all(sock)
    sock.close()
    assert ended and b'"code":"client_not_reading"' in body and b"KVGATE_MAX_UNREAD_REPLIES" in body
    events = body.count(b"data: ")  # what the socket's buffers held, then the error and [DONE]
    assert BOUND < events < 16 * 1500
    worker_log = (stack.state / "worker.log").read_text()
    assert "on cancel" in worker_log  # the worker stopped it: the rest was never generated


def test_a_client_that_reads_nothing_of_a_large_answer_is_let_go(stack):
    """A non-streamed answer (~7 MB, within KVGATE_MAX_ANSWER_LOGPROBS: more than the sockets'
    buffers hold) goes out in pieces, each
    within the write timeout: the gateway lets a client that stalls go, resetting its connection
    (closed, it would keep the unsent bytes and the kernel's buffer while the client's window is
    shut), and logs no error for it."""
    log = stack.state / "gateway.log"
    since = len(log.read_text())
    sock = _unread_stream(stack, {**BIG, "n": 8, "stream": False})  # 8 x 1,500 x 21 logprobs
    port = sock.getsockname()[1]
    _until_logged(log, "let go", since=since)
    gateway = psutil.Process(int((stack.state / "gateway.pid").read_text()))
    deadline = time.monotonic() + 5
    while any(c.raddr and c.raddr.port == port for c in gateway.net_connections(kind="tcp")):
        assert time.monotonic() < deadline, "the gateway still holds the stalled connection"
        time.sleep(0.1)
    with pytest.raises((ConnectionResetError, AssertionError)):  # reset; or closed short of the end
        body, ended = _read_all(sock)
        assert ended, "the whole answer came"
    sock.close()
    assert '"level":"ERROR"' not in log.read_text()[since:]  # a client let go is no server error


def _connected(stack) -> socket.socket:
    host, port = stack.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)))


def _closed_after(sock: socket.socket) -> float:
    """Seconds until the server closes the connection (it sends nothing first)."""
    started = time.monotonic()
    sock.settimeout(READ_TIMEOUT_S * 5)
    assert sock.recv(1024) == b""
    return time.monotonic() - started


@pytest.mark.parametrize("sent", [b"", b"POST /v1/chat/completions HTTP/1.1\r\nHost: kvgate\r\nAuthor"],
                         ids=["nothing", "half a head"])
def test_a_connection_without_a_whole_head_is_closed(stack, sent):
    sock = _connected(stack)
    sock.sendall(sent)
    assert READ_TIMEOUT_S - 0.5 < _closed_after(sock) < READ_TIMEOUT_S * 3
    sock.close()


@pytest.mark.parametrize("path, content_type", [("/v1/chat/completions", b"application/json"),
                                                ("/v1/files", b"multipart/form-data; boundary=x")])
def test_a_body_that_stops_coming_is_a_408(stack, path, content_type):
    sock = _connected(stack)
    sock.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: kvgate\r\nAuthorization: Bearer "
                 + stack.key.encode() + b"\r\nContent-Type: " + content_type
                 + b"\r\nContent-Length: 100000\r\n\r\n--x\r\n")
    sock.settimeout(READ_TIMEOUT_S * 5)
    answer = sock.recv(1 << 16)
    while b"\r\n\r\n" not in answer or len(answer.split(b"\r\n\r\n", 1)[1]) < int(
            answer.lower().split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0]):
        answer += sock.recv(1 << 16)  # the head and the body may come apart
    sock.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer[:300]
    error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
    assert error["code"] == "request_timeout" and "KVGATE_CLIENT_READ_TIMEOUT_S" in error["message"]


def test_a_kept_alive_connection_may_idle_between_requests(stack):
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {stack.key}"}) as client:
        first = client.get("/v1/models")
        time.sleep(READ_TIMEOUT_S + 1)  # idle: uvicorn's keep-alive (75 s here) governs, not the head's
        second = client.get("/v1/models")
    assert first.status_code == second.status_code == 200
    assert first.extensions["network_stream"] is second.extensions["network_stream"]  # one connection


def _responses(sock: socket.socket, count: int) -> list[tuple[bytes, bytes]]:
    """The next `count` responses (status line, body) of a connection; the bodies by Content-Length."""
    sock.settimeout(30)
    data, answers = b"", []
    while len(answers) < count:
        if b"\r\n\r\n" in data:
            head, rest = data.split(b"\r\n\r\n", 1)
            length = int(head.lower().split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])
            if len(rest) >= length:
                answers.append((head.split(b"\r\n", 1)[0], rest[:length]))
                data = rest[length:]
                continue
        chunk = sock.recv(1 << 16)
        assert chunk, f"closed after {len(answers)} of {count} responses"
        data += chunk
    return answers


def _get(stack, extra: bytes = b"", path: bytes = b"/v1/models") -> bytes:
    return (b"GET " + path + b" HTTP/1.1\r\nHost: kvgate\r\nAuthorization: Bearer "
            + stack.key.encode() + b"\r\n" + extra + b"\r\n")


def test_heads_within_the_bound_are_served_even_when_they_arrive_together(stack):
    """Two pipelined requests whose heads are each just under the bound, in one send: together
    longer than it, each counted on its own; and a POST whose head and body come in one piece."""
    near = b"X-Pad: " + b"p" * (HEAD_BYTES - 400) + b"\r\n"
    sock = _connected(stack)
    sock.sendall(_get(stack, near) + _get(stack, near))
    assert [status for status, _ in _responses(sock, 2)] == [b"HTTP/1.1 200 OK"] * 2
    body = json.dumps({"model": "demo", "prompt": "hi " * 6000}).encode()
    sock.sendall(b"POST /tokenize HTTP/1.1\r\nHost: kvgate\r\nAuthorization: Bearer "
                 + stack.key.encode() + b"\r\nContent-Type: application/json\r\nContent-Length: "
                 + str(len(body)).encode() + b"\r\n" + near + b"\r\n" + body)
    (status, answer), = _responses(sock, 1)
    sock.close()
    assert len(body) > HEAD_BYTES and status == b"HTTP/1.1 200 OK", answer
    assert json.loads(answer)["count"] > 0


@pytest.mark.parametrize("part", ["headers", "url"])
def test_a_head_past_the_bound_is_a_431_and_nothing_is_kept(stack, part):
    gateway = psutil.Process(int((stack.state / "gateway.pid").read_text()))
    sock = _connected(stack)
    if part == "url":
        sock.sendall(b"GET /v1/models?q=" + b"u" * (HEAD_BYTES + 100))
    else:
        sock.sendall(_get(stack)[:-2] + b"X-Pad: " + b"p" * HEAD_BYTES)
    (status, answer), = _responses(sock, 1)
    assert status == b"HTTP/1.1 431 Request Header Fields Too Large"
    error = json.loads(answer)["error"]
    assert error["code"] == "request_head_too_large" and "KVGATE_MAX_HEAD_BYTES" in error["message"]
    sock.settimeout(5)
    assert sock.recv(1024) == b""  # and closed
    sock.close()
    # a client that goes on sending is cut off long before the gateway holds what it sent
    before = gateway.memory_info().rss
    sock = _connected(stack)
    sock.sendall(_get(stack)[:-2])
    sent = 0
    with pytest.raises(OSError):  # reset, or broken pipe
        while sent < 256 << 20:
            sock.sendall(b"X-Pad: " + b"p" * 4000 + b"\r\n")
            sent += 4009
    sock.close()
    assert sent < 16 << 20 and gateway.memory_info().rss - before < 16 << 20


def _chunked(stack, pieces: list[bytes], path: bytes = b"/tokenize") -> bytes:
    return (b"POST " + path + b" HTTP/1.1\r\nHost: kvgate\r\nAuthorization: Bearer " + stack.key.encode()
            + b"\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
            + b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for piece in pieces) + b"0\r\n\r\n")


def test_a_body_in_tiny_chunks_is_refused_and_one_in_fair_chunks_served(stack):
    """Each chunk costs the loop a parser callback: a body in one-byte chunks is refused after a
    thousand or so (400 too_many_chunks, closed), one in 700-byte chunks is read whole."""
    body = json.dumps({"model": "demo", "prompt": "hi " * 1000}).encode()
    sock = _connected(stack)
    sock.sendall(_chunked(stack, [body[i:i + 1] for i in range(len(body))]))
    (status, answer), = _responses(sock, 1)
    sock.close()
    assert status == b"HTTP/1.1 400 Bad Request"
    error = json.loads(answer)["error"]
    assert error["code"] == "too_many_chunks" and "1024" in error["message"]
    body = json.dumps({"model": "demo", "prompt": "hi " * 300_000}).encode()  # ~900 KB
    sock = _connected(stack)
    sock.sendall(_chunked(stack, [body[i:i + 700] for i in range(0, len(body), 700)]))
    (status, answer), = _responses(sock, 1)
    sock.close()
    assert len(body) // 700 > 1024 and status == b"HTTP/1.1 200 OK", answer[:300]
    assert json.loads(answer)["count"] > 0


@pytest.mark.parametrize("key", [None, "sk-not-a-key"], ids=["no key", "a wrong key"])
def test_a_body_is_not_read_before_its_key_is_known(stack, key):
    """A POST without a valid key is answered as soon as its head is in: the gateway does not wait
    for (or parse) a body it would refuse. Waiting, it would have answered 408 after the read
    timeout."""
    sock = _connected(stack)
    auth = b"" if key is None else b"Authorization: Bearer " + key.encode() + b"\r\n"
    started = time.monotonic()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: kvgate\r\n" + auth
                 + b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{")
    (status, answer), = _responses(sock, 1)
    sock.close()
    assert status == b"HTTP/1.1 401 Unauthorized" and time.monotonic() - started < READ_TIMEOUT_S
    assert json.loads(answer)["error"]["code"] == "invalid_api_key"


def _refused(stack, reason: str) -> float:
    page = httpx.get(f"{stack.url}/metrics").text
    line = f'kvgate_gateway_connections_refused_total{{reason="{reason}"}} '
    return float(page.split(line, 1)[1].split("\n", 1)[0])


def test_a_connection_may_pipeline_a_few_requests_not_thousands(stack):
    """Pipelined requests are answered in order; a connection with more than 32 waiting behind the
    one being answered is closed (uvicorn parsed and queued all a piece held: ~75 MB for 1 MiB of
    GETs), counted in kvgate_gateway_connections_refused_total."""
    sock = _connected(stack)
    sock.sendall(_get(stack) * 8)
    assert [status for status, _ in _responses(sock, 8)] == [b"HTTP/1.1 200 OK"] * 8
    sock.close()
    before = _refused(stack, "too_many_pipelined")
    sock = _connected(stack)
    sock.sendall(_get(stack) * 2000)
    sock.settimeout(30)
    received = b""
    with contextlib.suppress(ConnectionResetError):  # closed with requests unread: a reset
        while chunk := sock.recv(1 << 16):
            received += chunk
    sock.close()
    assert received.count(b"HTTP/1.1 200 OK") < 2000
    assert _refused(stack, "too_many_pipelined") == before + 1
    # a stream being answered when its connection is closed for this is told its client left (as
    # for any disconnect it may be resumed, so its worker goes on); it wrote on into the closed
    # connection, an ERROR each time
    worker_log, gateway_log = stack.state / "worker.log", stack.state / "gateway.log"
    since, gateway_since = len(worker_log.read_text()), len(gateway_log.read_text())
    raw = json.dumps({**BIG, "n": 1, "logprobs": None}).encode()
    stream = (b"POST /v1/completions HTTP/1.1\r\nHost: kvgate\r\nAuthorization: Bearer "
              + stack.key.encode() + b"\r\nContent-Type: application/json\r\nContent-Length: "
              + str(len(raw)).encode() + b"\r\n\r\n" + raw)
    sock = _connected(stack)
    sock.sendall(stream)
    sock.settimeout(30)
    assert sock.recv(1 << 16).startswith(b"HTTP/1.1 200 OK")  # streaming
    sock.sendall(_get(stack) * 40)
    _until_logged(worker_log, "request finished", since=since, timeout=60)
    sock.close()
    assert '"level":"ERROR"' not in gateway_log.read_text()[gateway_since:]  # the client left: no error


@pytest.fixture
def small_answers(stack):
    """A second gateway on the stack's Redis, whose answers may carry 2,000 log-probabilities (the
    stack's own keeps the default: the large answer above must pass it)."""
    from tests.integration.test_governance import _free_port

    port = _free_port()
    env = {**os.environ, "KVGATE_SECRET": (stack.state / "server.secret").read_text().strip(),
           "KVGATE_API_KEY": stack.key, "KVGATE_MAX_ANSWER_LOGPROBS": "2000",
           "PROMETHEUS_MULTIPROC_DIR": str(stack.state / "metrics-small-answers")}
    with open(stack.state / "gateway-small-answers.log", "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "kvgate", "gateway", "--port", str(port),
                                 "--redis-url", stack.redis_url], env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait(lambda: httpx.get(url + "/readyz", timeout=1).status_code == 200, proc)
        yield url
    finally:
        stop_stack(proc)


def test_a_non_streamed_answer_carries_a_bounded_number_of_logprobs(stack, small_answers):
    """A whole answer is held in the gateway until it is done, its log-probabilities ~330 bytes each:
    past KVGATE_MAX_ANSWER_LOGPROBS (each token's and each top alternative count one) the request
    ends with 400 answer_too_large and its worker stops; within it, served whole; streamed, the
    same request has no such bound (the unread bound governs it)."""
    headers = {"Authorization": f"Bearer {stack.key}"}
    body = {"model": "demo", "prompt": "hi", "n": 2, "logprobs": 5, "ignore_eos": True}
    within = httpx.post(f"{small_answers}/v1/completions", headers=headers, timeout=60,
                        json={**body, "max_tokens": 150})  # 2 x 150 x 6 = 1,800
    assert within.status_code == 200, within.text
    for choice in within.json()["choices"]:
        assert len(choice["logprobs"]["top_logprobs"]) == 150
        assert all(len(top) == 5 for top in choice["logprobs"]["top_logprobs"])
    worker_log = stack.state / "worker.log"
    since = len(worker_log.read_text())
    beyond = httpx.post(f"{small_answers}/v1/completions", headers=headers, timeout=60,
                        json={**body, "max_tokens": 1500})  # 18,000
    assert beyond.status_code == 400, beyond.text
    error = beyond.json()["error"]
    assert error["code"] == "answer_too_large" and "KVGATE_MAX_ANSWER_LOGPROBS" in error["message"]
    _until_logged(worker_log, "on cancel", since=since, timeout=30)  # not generated to the end
    with httpx.stream("POST", f"{small_answers}/v1/completions", headers=headers, timeout=60,
                      json={**body, "max_tokens": 1500, "stream": True}) as streamed:
        events = [line for line in streamed.iter_lines() if line.startswith("data: {")]
    assert len(events) == 2 * 1500 and '"error"' not in events[-1]
