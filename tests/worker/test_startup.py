"""`kvgate worker --model DIR` as a user starts it: served as the folder's name, its KV size and
context in one start-up line, in /metrics and in its registry entry, all agreeing; a context the KV
cache cannot hold stops it at once with what to change."""
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import orjson
import redis

from shared import names
from shared.settings import WorkerSettings, served_name_for


def test_a_worker_serves_its_folders_name_and_says_how_big_its_kv_cache_is(tiny_model_dir, redis_server,
                                                                             tmp_path):
    log = tmp_path / "worker.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvgate", "worker", "--model", str(tiny_model_dir),
                                 "--redis-url", redis_server.url, "--max-num-seqs", "8"],
                                env={**os.environ, "KVGATE_WORKER_ID": "w-startup"}, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        info = _registry_entry(redis_server.url, "w-startup", proc, log)
        metrics = _scrape(info["metrics_url"], tiny_model_dir.name)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    assert info["served_name"] == tiny_model_dir.name  # "tiny-llama0", not "demo"
    assert info["stream"] == names.request_stream(tiny_model_dir.name, "v1")
    blocks, tokens, max_len = info["kv_blocks"], info["kv_tokens"], info["max_model_len"]
    assert tokens == blocks * info["kv_block_size"] and info["kv_bytes"] == tokens * 512
    assert max_len == 2048 and info["kv_max_concurrency"] == round(tokens / max_len, 2) == 8.0
    line = next(orjson.loads(raw) for raw in log.read_bytes().splitlines()
                if raw.startswith(b"{") and b'"KV cache:' in raw)
    assert f"{blocks} blocks x 16 tokens = {tokens} tokens" in line["msg"]
    assert f"max_model_len {max_len}: 8 sequences of full length fit" in line["msg"]
    assert (metrics["kvgate_kv_cache_blocks"], metrics["kvgate_kv_cache_tokens"],
            metrics["kvgate_max_model_len"]) == (blocks, tokens, max_len)


def test_a_max_model_len_the_kv_cache_cannot_hold_stops_the_worker_with_what_to_change(tiny_model_dir):
    proc = subprocess.run([sys.executable, "-m", "kvgate", "worker", "--model", str(tiny_model_dir),
                           "--max-model-len", "4096", "--kv-cache-memory", "1000000",
                           "--redis-url", "redis://127.0.0.1:1/0"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert ("raise --kv-cache-memory (KVGATE_KV_CACHE_MEMORY) to at least 2097152 bytes, or lower "
            "--max-model-len to at most 1952") in proc.stderr


def test_the_default_served_name_is_the_folders(tmp_path):
    snapshot = "/home/u/.cache/huggingface/hub/models--Qwen--Qwen3-0.6B/snapshots/0123abc"
    assert served_name_for(snapshot) == "Qwen3-0.6B"
    assert served_name_for(str(tmp_path / "models" / "Llama-3.2-1B") + "/") == "Llama-3.2-1B"
    assert served_name_for(str(tmp_path / "a" / ".." / "b")) == "b"
    assert WorkerSettings(model="/m/Qwen3-0.6B").served_name == "Qwen3-0.6B"
    assert WorkerSettings(model="/m/Qwen3-0.6B", served_name="qwen").served_name == "qwen"


def _registry_entry(redis_url: str, worker_id: str, proc: subprocess.Popen, log) -> dict:
    client = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            if raw := client.get(names.worker_key(worker_id)):
                return orjson.loads(raw)
            time.sleep(0.2)
    finally:
        client.close()
    raise TimeoutError(log.read_text())


def _scrape(url: str, model: str) -> dict[str, float]:
    """Gauge name -> value of the series labelled with `model`."""
    values = {}
    series = re.finditer(r'^(kvgate_\w+)\{model="([^"]*)",version="v1"\} (\S+)$', httpx.get(url).text, re.M)
    for match in series:
        if match[2] == model:
            values[match[1]] = float(match[3])
    return values
