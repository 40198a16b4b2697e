"""Files and batches under quota, against real gateway processes (two, sharing one Redis and one data
folder, as replicas do) and the official `openai` client: the key is checked before an upload's
body is read, uploads stream to disk (the gateway's memory stays flat), per-key quotas are exact
across replicas and give back what is deleted, and the routes count against requests per minute."""
from __future__ import annotations

import io
import os
import secrets
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import redis

from shared import names
from shared.redis_server import RedisServer, free_port

ADMIN = "sk-kvg-uploads-admin"
SECRET = "uploads-test-secret"


class Gateways:
    def __init__(self, root: Path, count: int):
        self.root = root
        self.redis = RedisServer(port=free_port(), data_dir=root / "redis").start()
        self.procs: list[subprocess.Popen] = []
        self.urls: list[str] = []
        env = {**os.environ, "KVGATE_SECRET": SECRET, "KVGATE_ADMIN_KEY": ADMIN,
               "KVGATE_DATA_DIR": str(root / "data"), "KVGATE_MAX_FILE_LINES": "100000"}
        for i in range(count):
            port = free_port()
            log = open(root / f"gateway{i}.log", "ab")
            # its metrics folder under the test's own: a killed gateway cannot remove one in /tmp
            metrics = {"PROMETHEUS_MULTIPROC_DIR": str(root / f"metrics{i}")}
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "kvgate", "gateway", "--port", str(port), "--redis-url",
                 self.redis.url], stdout=log, stderr=subprocess.STDOUT, env={**env, **metrics},
                start_new_session=True))
            self.urls.append(f"http://127.0.0.1:{port}")
        for proc, url in zip(self.procs, self.urls):
            self._wait_ready(proc, url)

    @staticmethod
    def _wait_ready(proc: subprocess.Popen, url: str) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"gateway exited with {proc.returncode}"
            try:
                if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError("gateway did not become ready")

    def key(self, **fields) -> tuple[str, dict]:
        """A new key's secret and record, made through the admin API."""
        resp = httpx.post(self.urls[0] + "/admin/keys", headers={"Authorization": f"Bearer {ADMIN}"},
                          json={"name": "up-" + secrets.token_hex(4), **fields})
        assert resp.status_code == 201, resp.text
        return resp.json()["secret"], resp.json()["key"]

    def patch(self, key_id: str, **fields) -> dict:
        resp = httpx.patch(f"{self.urls[0]}/admin/keys/{key_id}", json=fields,
                           headers={"Authorization": f"Bearer {ADMIN}"})
        assert resp.status_code == 200, resp.text
        return resp.json()

    def client(self, secret: str, gateway: int = 0) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.urls[gateway] + "/v1", api_key=secret, max_retries=0)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.redis.stop()


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    g = Gateways(tmp_path_factory.mktemp("uploads"), 2)
    yield g
    g.close()


def jsonl(n_bytes: int, tag: str = "x") -> bytes:
    """n_bytes of batch lines (about 1 kB each, fewer bytes for a small file)."""
    pad = b"x" * min(900, max(0, n_bytes - 200))
    line = (b'{"custom_id": "%s", "method": "POST", "url": "/v1/completions", "body": {"prompt": "%s"}}\n'
            % (tag.encode(), pad))
    body = line * (n_bytes // len(line))
    return body + b" " * (n_bytes - len(body))


def upload(client: openai.OpenAI, content: bytes, name: str = "in.jsonl"):
    return client.files.create(file=(name, io.BytesIO(content)), purpose="batch")


def quota_error(call) -> str:
    with pytest.raises(openai.RateLimitError) as refused:
        call()
    error = refused.value.body
    assert refused.value.status_code == 429
    assert (error["type"], error["code"]) == ("insufficient_quota", "quota_exceeded"), error
    return error["message"]


def _cli(gw: Gateways, *args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "kvgate", "keys", *args, "--json", "--url", gw.urls[1],
                          "--admin-key", ADMIN], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def stored(gw: Gateways, key_id: str) -> dict[bytes, bytes]:
    r = redis.Redis.from_url(gw.redis.url)
    try:
        return r.hgetall(names.stored_by(key_id))
    finally:
        r.close()


# -- the key first ---------------------------------------------------------------------------
def _raw_upload(url: str, token: str | None, declared: int, sent: bytes,
                wait_s: float = 5) -> tuple[bytes, float]:
    """Headers declaring a `declared`-byte body, then only `sent` of it: what the server answers
    within `wait_s` (b"" if nothing) and after how long."""
    host, port = url.removeprefix("http://").split(":")
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    head = (f"POST /v1/files HTTP/1.1\r\nHost: {host}\r\nContent-Length: {declared}\r\n"
            f"Content-Type: multipart/form-data; boundary=xyz\r\n{auth}\r\n").encode()
    answer = b""
    with socket.create_connection((host, int(port)), timeout=wait_s) as s:
        s.sendall(head + sent)
        start = time.monotonic()
        try:
            while not answer.endswith(b"}"):  # the error body is the answer's last byte
                more = s.recv(4096)
                if not more:
                    break
                answer += more
        except TimeoutError:
            pass
        return answer, time.monotonic() - start


def test_an_upload_without_a_valid_key_is_refused_before_its_body_is_read(gw):
    declared = 60_000_000  # under KVGATE_MAX_FILE_BYTES: only the key can refuse it
    for token in (None, "sk-kvg-not-a-key"):
        answer, waited = _raw_upload(gw.urls[0], token, declared, b"--xyz\r\n")
        status = int(answer.split(b" ", 2)[1])
        assert status in (401, 429), answer  # 429: the failed-auth throttle answered first
        assert waited < 2, waited  # answered with 7 of 60,000,000 bytes sent: the body was not read
        assert b'"error"' in answer
    secret, _ = gw.key()
    answer, waited = _raw_upload(gw.urls[0], secret, declared, b"--xyz\r\n", wait_s=2)
    assert answer == b"" and waited >= 1.9  # a good key: the gateway waits for the file itself
    assert list((gw.root / "data" / "files").glob(".*.tmp")) == []  # and left nothing when cut off


# -- quotas ----------------------------------------------------------------------------------
def test_each_quota_is_a_429_naming_it_and_an_admin_override_raises_it(gw):
    secret, key = gw.key(max_files=2)
    client = gw.client(secret)
    upload(client, jsonl(100))
    first = upload(client, jsonl(100))
    message = quota_error(lambda: upload(client, jsonl(100)))
    assert f"key '{key['name']}' on files (max_files): Limit 2, Used 2, Requested 1" in message
    assert gw.patch(key["id"], max_files=3)["max_files"] == 3
    upload(client, jsonl(100))
    assert gw.patch(key["id"], max_files=None)["max_files"] is None  # back to the default (1000)
    upload(client, jsonl(100))
    shown = _cli(gw, "update", key["name"], "--max-files", "4", "--max-stored-bytes", "1000000")
    assert '"max_files": 4' in shown and '"max_stored_bytes": 1000000' in shown
    quota_error(lambda: upload(client, jsonl(100)))  # the CLI's limit holds: 4 files kept
    assert '"max_files": null' in _cli(gw, "update", key["name"], "--clear", "max-files")

    # batches in progress: none runs here (no Celery), so each stays in `validating`
    assert gw.patch(key["id"], max_batches_in_progress=1)["max_batches_in_progress"] == 1
    create = lambda: client.batches.create(input_file_id=first.id, endpoint="/v1/completions",  # noqa: E731
                                           completion_window="24h")
    create()
    message = quota_error(create)
    assert "on batches in progress (max_batches_in_progress): Limit 1, Used 1" in message
    gw.patch(key["id"], max_batches_in_progress=2)
    assert create().status == "validating"


def test_stored_bytes_are_held_exactly_and_deleting_a_file_gives_them_back(gw):
    secret, key = gw.key(max_stored_bytes=1000)
    client = gw.client(secret, gateway=1)
    kept = upload(client, jsonl(600, "a"))
    message = quota_error(lambda: upload(client, jsonl(600, "b")))
    assert "on stored bytes (max_stored_bytes): Limit 1000, Used 600, Requested 600" in message
    upload(client, jsonl(400, "c"))  # exactly what is left still fits
    assert client.files.delete(kept.id).deleted
    upload(client, jsonl(600, "d"))
    entries = stored(gw, key["id"])
    assert sorted(int(v) for v in entries.values()) == [400, 600]  # two files; no hold left behind
    with pytest.raises(openai.APIStatusError) as big:  # over the size limit: nothing kept either
        upload(client, jsonl(70 << 20))
    assert big.value.status_code == 413  # refused by its declared length
    assert stored(gw, key["id"]) == entries


def test_an_upload_crossing_the_size_limit_is_stopped_there_and_leaves_nothing(gw):
    secret, key = gw.key()
    head = (b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            b'--b\r\nContent-Disposition: form-data; name="file"; filename="x.jsonl"\r\n\r\n')
    chunk = jsonl(1 << 20)

    def body():  # no declared length (chunked): only the stream itself can show the size
        yield head
        for _ in range(65):
            yield chunk

    resp = httpx.post(gw.urls[1] + "/v1/files", content=body(), timeout=60, headers={
        "Authorization": f"Bearer {secret}", "Content-Type": "multipart/form-data; boundary=b"})
    assert resp.status_code == 413 and "67108864 bytes (KVGATE_MAX_FILE_BYTES)" in resp.text
    assert list((gw.root / "data" / "files").glob(".*.tmp")) == []
    assert stored(gw, key["id"]) == {}


def test_concurrent_uploads_over_two_gateways_never_pass_the_byte_quota(gw):
    limit, size, tries = 1_000_000, 240_000, 12
    secret, key = gw.key(max_stored_bytes=limit)
    clients = [gw.client(secret, 0), gw.client(secret, 1)]

    def one(i: int):
        try:
            return upload(clients[i % 2], jsonl(size, str(i))).bytes
        except openai.RateLimitError as exc:
            assert exc.body["code"] == "quota_exceeded" and "stored bytes" in exc.body["message"]
            return 0

    with ThreadPoolExecutor(tries) as pool:
        kept = [n for n in pool.map(one, range(tries)) if n]
    listed = clients[0].files.list().data
    print(f"\n{len(kept)} of {tries} concurrent {size}-byte uploads kept under a {limit}-byte quota")
    assert 1 <= len(kept) <= limit // size and sum(f.bytes for f in listed) == sum(kept) <= limit
    assert sorted(int(v) for v in stored(gw, key["id"]).values()) == sorted(kept)


def test_a_line_longer_than_any_request_body_is_refused_at_upload(gw):
    # the batch runner parses each line whole, into ~30 times its size: a 57 MB line took its
    # process (every batch's) 1.8 GB, only for the gateway to refuse the body (413) when sent
    client = gw.client(gw.key()[0])
    limit = 6 << 20  # 6 x KVGATE_MAX_BODY_BYTES (1 MiB): a body of the limit, every character escaped
    opening = b'{"custom_id": "long", "method": "POST", "url": "/v1/completions", "body": {"prompt": "'

    def line(size: int) -> bytes:
        return opening + b"x" * (size - len(opening) - 3) + b'"}}'

    assert upload(client, jsonl(3000) + b"  " + line(limit) + b"\n" + jsonl(3000)).bytes > limit
    with pytest.raises(openai.BadRequestError) as refused:
        upload(client, jsonl(3000) + line(limit + 1) + b"\n")
    error = refused.value.body
    assert error["code"] == "line_too_long" and error["param"] == "file"
    assert f"{limit} bytes" in error["message"] and "KVGATE_MAX_BODY_BYTES" in error["message"]


def test_a_50_mb_upload_leaves_the_gateways_memory_flat(gw):
    secret, _ = gw.key()
    client = gw.client(secret)
    upload(client, jsonl(5 << 20))  # warm: every code path of an upload has run once
    pid = gw.procs[0].pid
    before = _memory_kb(pid)
    boundary = "kvgate-rss"
    head = (f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n'
            "Content-Type: application/jsonl\r\n\r\n").encode()
    tail = f"\r\n--{boundary}--\r\n".encode()
    chunk, chunks = jsonl(1 << 20), 50

    def body():
        yield head
        for _ in range(chunks):
            yield chunk
        yield tail

    resp = httpx.post(gw.urls[0] + "/v1/files", content=body(), timeout=120, headers={
        "Authorization": f"Bearer {secret}", "Content-Type": f"multipart/form-data; boundary={boundary}",
        "Content-Length": str(len(head) + len(chunk) * chunks + len(tail))})
    assert resp.status_code == 200, resp.text
    assert resp.json()["bytes"] == len(chunk) * chunks
    after = _memory_kb(pid)
    grew_rss, grew_peak = (after[0] - before[0]) / 1024, (after[1] - before[1]) / 1024
    print(f"\ngateway after a {len(chunk) * chunks / 1e6:.0f} MB upload: RSS {grew_rss:+.1f} MB, "
          f"peak RSS {grew_peak:+.1f} MB")
    assert grew_rss < 8 and grew_peak < 8


def _memory_kb(pid: int) -> tuple[int, int]:
    """VmRSS and VmHWM (the peak) of a process, in kB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])


# -- requests per minute ---------------------------------------------------------------------
def test_files_and_batches_count_against_requests_per_minute_but_polling_a_batch_does_not(gw):
    files_only = gw.client(gw.key(rpm=3)[0])
    made = upload(files_only, jsonl(100))  # 1
    listed = files_only.files.with_raw_response.list()  # 2
    assert listed.headers["x-ratelimit-limit-requests"] == "3"
    assert listed.headers["x-ratelimit-remaining-requests"] == "1"
    files_only.files.retrieve(made.id)  # 3
    _rate_limited(lambda: files_only.files.content(made.id), 3)

    client = gw.client(gw.key(rpm=3)[0])
    made = upload(client, jsonl(100))  # 1
    batch = client.batches.create(input_file_id=made.id, endpoint="/v1/completions",  # 2
                                  completion_window="24h")
    client.batches.list()  # 3
    for call in (lambda: client.batches.cancel(batch.id), lambda: upload(client, jsonl(100)),
                 lambda: client.files.delete(made.id)):
        _rate_limited(call, 3)
    for _ in range(5):  # polling is exempt: a batch's owner may watch it as often as it likes
        assert client.batches.retrieve(batch.id).id == batch.id


def _rate_limited(call, rpm: int) -> None:
    with pytest.raises(openai.RateLimitError) as refused:
        call()
    assert refused.value.body["code"] == "rate_limit_exceeded"
    assert f"requests per minute (RPM): Limit {rpm}" in refused.value.body["message"]
