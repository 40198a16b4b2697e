"""Hostile input over every route, user and admin, against the whole stack (`kvgate up`): each case
gets its status in OpenAI's error shape, nothing crashes, and the stack still serves a normal
request afterwards with the same worker and gateway processes. Then schemathesis fuzzes
/openapi.json with a user key and with an admin key: no server error."""
from __future__ import annotations

import json
import secrets
import subprocess
import sys
from pathlib import Path

import httpx
import psutil
import pytest

from gateway import bounds
from tests.conftest import Stack, start_stack, stop_stack  # plain helpers (python -m pytest puts . on the path)

BIG = 123456789012345678901234567890  # beyond 64 bits
CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
TEXT = {"model": "demo", "prompt": "hi", "max_tokens": 2}


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    # a short context keeps the fuzzer's generated requests (any max_tokens it likes) quick to serve
    s = start_stack(tiny_model_dir, tmp_path_factory.mktemp("hostile"), "paged",
                    extra_env={"KVGATE_MAX_MODEL_LEN": "128"})
    s.admin_key = (s.state / "admin.key").read_text().strip()
    s.pids = {role: _child_pid(s, role) for role in ("gateway", "worker")}
    yield s
    stop_stack(s.proc)


def _raw(body: dict, **swap: str) -> bytes:
    """`body` as JSON with the placeholder strings in `swap` replaced by raw JSON text (what a
    client can send but no JSON library writes: lone surrogates, NaN, 30-digit integers)."""
    text = json.dumps(body)
    for placeholder, raw in swap.items():
        text = text.replace(json.dumps(placeholder), raw)
    return text.encode()


def _send(stack: Stack, method: str, path: str, content: bytes | None = None, key: str | None = None,
          **kw) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key or stack.key}"}
    if content is not None:
        headers["Content-Type"] = "application/json"
    return httpx.request(method, stack.url + path, content=content, headers=headers, timeout=60, **kw)


def _assert_error(resp: httpx.Response, status: int, param: str | None = "<any>") -> dict:
    assert resp.status_code == status, f"{resp.status_code} {resp.text[:300]}"
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param != "<any>":
        assert err["param"] == param, err
    return err


SURROGATE = '"a\\ud800b"'
V1_CASES = [
    # (name, path, raw body, status, param)
    ("surrogate in content", "/v1/chat/completions",
     _raw({**CHAT, "messages": [{"role": "user", "content": "S"}]}, S=SURROGATE), 422, None),
    ("surrogate in model", "/v1/completions", _raw({**TEXT, "model": "S"}, S=SURROGATE), 422, None),
    ("surrogate in stop", "/v1/completions", _raw({**TEXT, "stop": ["S"]}, S=SURROGATE), 422, None),
    ("surrogate in user", "/v1/chat/completions", _raw({**CHAT, "user": "S"}, S=SURROGATE), 422, None),
    ("surrogate in prompt", "/v1/completions", _raw({**TEXT, "prompt": "S"}, S=SURROGATE), 422, None),
    ("surrogate in a part", "/v1/chat/completions", _raw(
        {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "S"}]}]}, S=SURROGATE),
     422, None),
    ("NaN temperature", "/v1/completions", _raw({**TEXT, "temperature": "X"}, X="NaN"), 422, None),
    ("Infinity top_p", "/v1/completions", _raw({**TEXT, "top_p": "X"}, X="Infinity"), 422, None),
    ("1e400 penalty", "/v1/completions", _raw({**TEXT, "presence_penalty": "X"}, X="1e400"), 422, None),
    ("body is a list", "/v1/completions", b"[1, 2]", 422, None),
    ("body is null", "/v1/chat/completions", b"null", 422, None),
    ("truncated body", "/v1/chat/completions", b'{"model": "demo", "messages": [', 422, None),
    ("part not an object", "/v1/chat/completions",
     _raw({**CHAT, "messages": [{"role": "user", "content": [5]}]}), 422, "messages.0.content.0"),
    ("part text not a string", "/v1/chat/completions",
     _raw({**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": {"a": 1}}]}]}),
     422, "messages.0.content.0.text"),
    ("image part", "/v1/chat/completions", _raw({**CHAT, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]}),
     422, "messages.0.content.0.type"),
    ("unknown role", "/v1/chat/completions",
     _raw({**CHAT, "messages": [{"role": "root", "content": "x"}]}), 422, "messages.0.role"),
    ("no messages", "/v1/chat/completions", _raw({**CHAT, "messages": []}), 422, "messages"),
    ("model name too long", "/v1/completions", _raw({**TEXT, "model": "m" * 300}), 422, "model"),
    ("unknown model", "/v1/completions", _raw({**TEXT, "model": "no-such-model"}), 404, "model"),
    ("prompt_logprobs above 20", "/v1/completions", _raw({**TEXT, "prompt_logprobs": 21}), 422,
     "prompt_logprobs"),
    ("a batch of 17 prompts", "/v1/completions", _raw({**TEXT, "prompt": ["a"] * 17}), 422, "prompt"),
    ("a batch's prompts × n past 16", "/v1/completions", _raw({**TEXT, "prompt": [[1, 2], [3]] * 3, "n": 3}), 422,
     "prompt"),
    ("a batch of one token-id prompt, its id negative", "/v1/completions",
     _raw({**TEXT, "prompt": [[1, -7]]}), 422, "<any>"),
    ("negative token id", "/v1/completions", _raw({**TEXT, "prompt": [1, -7]}), 422, "<any>"),
    ("token id beyond the vocabulary", "/v1/completions", _raw({**TEXT, "prompt": [10_000_000]}),
     400, "prompt"),
    ("stop id beyond the vocabulary", "/v1/completions",
     _raw({**TEXT, "stop_token_ids": [99_999_999], "min_tokens": 1}), 400, "stop_token_ids"),
    ("too many stop ids", "/v1/completions",
     _raw({**TEXT, "stop_token_ids": [1] * (bounds.STOP_TOKEN_IDS + 1)}), 422, "stop_token_ids"),
    ("too many stops", "/v1/completions", _raw({**TEXT, "stop": list("abcde")}), 422, "stop"),
    ("stop too long", "/v1/completions", _raw({**TEXT, "stop": ["s" * (bounds.STOP_CHARS + 1)]}),
     422, "stop.0"),
    ("empty stop", "/v1/completions", _raw({**TEXT, "stop": [""]}), 422, "stop.0"),
    ("min_tokens above max_tokens", "/v1/completions", _raw({**TEXT, "min_tokens": 5}), 400, "min_tokens"),
    ("max_tokens beyond the context", "/v1/completions", _raw({**TEXT, "max_tokens": 1_000_000}),
     400, "max_tokens"),
    ("n too large", "/v1/completions", _raw({**TEXT, "n": 17}), 422, "n"),
    ("logprobs too large", "/v1/completions", _raw({**TEXT, "logprobs": 21}), 422, "logprobs"),
    ("top_logprobs too large", "/v1/chat/completions",
     _raw({**CHAT, "logprobs": True, "top_logprobs": 50}), 422, "top_logprobs"),
    ("user too long", "/v1/chat/completions", _raw({**CHAT, "user": "u" * 600}), 422, "user"),
    ("priority better than the key's", "/v1/completions", _raw({**TEXT, "priority": -5}), 403, "priority"),
    # near the body limit, each refused at its first bad entry (a report each cost seconds)
    ("200,000 negative token ids", "/v1/completions", _raw({**TEXT, "prompt": [-1] * 200_000}), 422,
     "<any>"),
    ("40,000 parts without text", "/v1/chat/completions", _raw(
        {**CHAT, "messages": [{"role": "user", "content": [{"type": "text"}] * 40_000}]}), 422,
     "messages.0.content.0.text"),
    ("60,000 logit_bias entries", "/v1/chat/completions",
     _raw({**CHAT, "logit_bias": {str(-i): 1 for i in range(1, 60_000)}}), 422, "logit_bias"),
] + [
    (f"{field} beyond 64 bits", "/v1/completions", _raw({**TEXT, field: "X"}, X=str(BIG)), 422, field)
    for field in ("max_tokens", "seed", "n", "top_k", "priority", "min_tokens", "logprobs")
] + [
    (f"{field} beyond 64 bits, negative", "/v1/completions", _raw({**TEXT, field: "X"}, X=str(-BIG)),
     422, field) for field in ("seed", "priority", "top_k")
]


@pytest.mark.parametrize("name, path, body, status, param", V1_CASES, ids=[c[0] for c in V1_CASES])
def test_v1_hostile_inputs_get_clear_errors(stack, name, path, body, status, param):
    _assert_error(_send(stack, "POST", path, body), status, param)


ROUTE_CASES = [
    # (name, method, path, request kwargs, which key, status, param)
    ("upload without a key", "POST", "/v1/files",
     {"files": {"file": ("a.jsonl", b"{}\n")}, "data": {"purpose": "batch"}}, None, 401, "<any>"),
    ("upload with a wrong key", "POST", "/v1/files",
     {"files": {"file": ("a.jsonl", b"{}\n")}, "data": {"purpose": "batch"}}, "sk-kvg-wrong", 401, "<any>"),
    ("upload for another purpose", "POST", "/v1/files",
     {"files": {"file": ("a.jsonl", b"{}\n")}, "data": {"purpose": "assistants"}}, "user", 400, "purpose"),
    ("upload that is not UTF-8", "POST", "/v1/files",
     {"files": {"file": ("a.jsonl", b"\xff\xfe{}\n")}, "data": {"purpose": "batch"}}, "user", 400, "file"),
    ("empty upload", "POST", "/v1/files",
     {"files": {"file": ("a.jsonl", b"")}, "data": {"purpose": "batch"}}, "user", 400, "file"),
    ("upload as JSON", "POST", "/v1/files", {"json": {"file": "x", "purpose": "batch"}}, "user", 400, "<any>"),
    ("files page of 0", "GET", "/v1/files", {"params": {"limit": 0}}, "user", 422, "limit"),
    ("files page beyond 64 bits", "GET", "/v1/files", {"params": {"limit": str(BIG)}}, "user", 422, "limit"),
    ("unknown file", "GET", "/v1/files/file-nope", {}, "user", 404, "<any>"),
    ("a path as a file id", "GET", "/v1/files/..%2F..%2Fetc%2Fpasswd/content", {}, "user", 404, "<any>"),
    ("batch of an unknown file", "POST", "/v1/batches", {"json": {
        "input_file_id": "file-nope", "endpoint": "/v1/completions", "completion_window": "24h"}},
     "user", 404, "input_file_id"),
    ("batch of a 100 kB file id", "POST", "/v1/batches", {"json": {
        "input_file_id": "file-" + "x" * 100_000, "endpoint": "/v1/completions", "completion_window": "24h"}},
     "user", 422, "input_file_id"),
    ("batch for another endpoint", "POST", "/v1/batches", {"json": {
        "input_file_id": "file-nope", "endpoint": "/v1/moderations", "completion_window": "24h"}},
     "user", 422, "endpoint"),
    ("batch with a 48h window", "POST", "/v1/batches", {"json": {
        "input_file_id": "file-nope", "endpoint": "/v1/completions", "completion_window": "48h"}},
     "user", 422, "completion_window"),
    ("batch with 17 metadata pairs", "POST", "/v1/batches", {"json": {
        "input_file_id": "file-nope", "endpoint": "/v1/completions", "completion_window": "24h",
        "metadata": {f"k{i}": "v" for i in range(17)}}}, "user", 422, "metadata"),
    ("batch with a surrogate in metadata", "POST", "/v1/batches", {"content": _raw({
        "input_file_id": "file-nope", "endpoint": "/v1/completions", "completion_window": "24h",
        "metadata": {"k": "S"}}, S=SURROGATE), "headers": {"Content-Type": "application/json"}},
     "user", 422, None),
    ("batches page of 1000", "GET", "/v1/batches", {"params": {"limit": 1000}}, "user", 422, "limit"),
    ("cancel an unknown batch", "POST", "/v1/batches/batch_nope/cancel", {}, "user", 404, "<any>"),
    ("admin route with a user key", "GET", "/admin/keys", {}, "user", 403, "<any>"),
    ("admin route without a key", "GET", "/admin/keys", {}, None, 401, "<any>"),
]


@pytest.mark.parametrize("name, method, path, kwargs, who, status, param", ROUTE_CASES,
                         ids=[c[0] for c in ROUTE_CASES])
def test_hostile_requests_on_every_route_get_clear_errors(stack, name, method, path, kwargs, who,
                                                          status, param):
    key = {"user": stack.key, "admin": stack.admin_key}.get(who, who)
    headers = {**kwargs.pop("headers", {}), **({"Authorization": f"Bearer {key}"} if key else {})}
    resp = httpx.request(method, stack.url + path, headers=headers, timeout=60, **kwargs)
    _assert_error(resp, status, param)


def _child_pid(stack: Stack, role: str) -> int:
    """The pid of `kvgate up`'s gateway or worker (a restarted child would have another)."""
    for proc in psutil.Process(stack.proc.pid).children(recursive=True):
        if proc.cmdline()[1:4] == ["-m", "kvgate", role]:
            return proc.pid
    raise AssertionError(f"no {role} process under kvgate up")


def _rss_mb(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


async def _flood(stack: Stack, names: list[str]) -> list[int]:
    import asyncio

    limit = asyncio.Semaphore(16)
    async with httpx.AsyncClient(base_url=stack.url, timeout=60,
                                 headers={"Authorization": f"Bearer {stack.key}"}) as client:
        async def one(name: str) -> int:
            async with limit:
                return (await client.post("/v1/completions", json={**TEXT, "model": name})).status_code
        return await asyncio.gather(*(one(n) for n in names))


def test_a_flood_of_made_up_model_names_leaves_gateway_memory_flat(stack):
    import asyncio

    pid = _child_pid(stack, "gateway")
    asyncio.run(_flood(stack, [secrets.token_hex(100) for _ in range(300)]))  # warm up
    before = _rss_mb(pid)
    huge = [secrets.token_hex(50_000) for _ in range(2000)]  # 100 KB names: refused by the schema
    short = [secrets.token_hex(100) for _ in range(2000)]  # 200-character names: routed, then 404
    statuses = asyncio.run(_flood(stack, huge)) + asyncio.run(_flood(stack, short))
    after = _rss_mb(pid)
    print(f"gateway RSS {before:.1f} MB -> {after:.1f} MB after {len(statuses)} made-up names")
    assert set(statuses[:2000]) == {422} and set(statuses[2000:]) == {404}
    assert after - before < 8, f"gateway RSS grew {after - before:.1f} MB"


@pytest.mark.parametrize("who", ["user", "admin"])
def test_schemathesis_finds_no_server_error(stack, who, tmp_path):
    """Every operation of /openapi.json, with generated valid and invalid data (bounded examples
    per operation, fixed seed so a failure reproduces)."""
    key = stack.key if who == "user" else stack.admin_key
    cli = Path(sys.executable).with_name("schemathesis")
    run = subprocess.run(
        [str(cli), "run", f"{stack.url}/openapi.json", "-H", f"Authorization: Bearer {key}",
         "--checks", "not_a_server_error", "--max-examples", "15", "--seed", "1", "--workers", "1",
         "--phases", "examples,coverage,fuzzing", "--request-timeout", "60", "--no-color"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path)
    tail = run.stdout[-4000:]
    assert run.returncode == 0, tail
    generated = [int(line.split()[0]) for line in run.stdout.splitlines() if "generated," in line]
    assert generated and generated[0] > 500, tail  # it really exercised the API
    print(f"schemathesis ({who} key): {generated[0]} cases, no server error")


def test_after_the_whole_suite_the_same_processes_serve_a_normal_request(stack):
    """Last in this module: every case above ran against these processes."""
    assert {role: _child_pid(stack, role) for role in stack.pids} == stack.pids
    resp = _send(stack, "POST", "/v1/completions", _raw({**TEXT, "max_tokens": 3, "ignore_eos": True}))
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 3
