"""A worker at tensor_parallel_size 2 (two processes, gloo) through the whole stack: it registers its
ranks, serves a stream, and when rank 1 is killed mid-stream the worker exits at once (70) and the
stream resumes on another worker (TP = 1) with the text an uninterrupted run gives."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest

from tests.integration.test_faults import Cluster, _body, _client, _stream
from worker.engine.ranks import RANK_DIED


@pytest.fixture
def cluster(tmp_path, tiny_model_dir):
    c = Cluster(tmp_path, tiny_model_dir)
    yield c
    c.close()


def test_tp2_worker_serves_and_a_dead_rank_hands_its_stream_to_another_worker(cluster):
    cluster.start_gateway()
    # its steps slowed (a slow device, 50 ms: 60 tokens take 3 s), so that rank 1 dies with most of
    # the stream still to come however far a busy client lags behind the worker (unslowed, the
    # worker once had all 60 tokens out before the client counted its fifth: nothing to resume)
    victim = cluster.start_worker("w-tp2", "--tensor-parallel-size", "2", KVGATE_TORCH_THREADS="2",
                                  KVGATE_FAULT_STEP_MS="50")
    info = cluster.info("w-tp2")
    assert info["tp_size"] == 2 and [r["rank"] for r in info["tp_ranks"]] == [0, 1]
    assert all(r["weight_bytes"] > 0 and r["kv_bytes"] > 0 for r in info["tp_ranks"])
    metrics = httpx.get(info["metrics_url"]).text
    assert 'kvgate_rank_memory_bytes{kind="kv",model="demo",rank="1",version="v1"}' in metrics
    rank1 = info["tp_ranks"][1]["pid"]
    body = _body(0, 60)
    chunks, killed, exited = [0], [0.0], [0.0]

    def kill_rank1_at_chunk_5() -> None:
        chunks[0] += 1
        if chunks[0] == 5:
            os.kill(rank1, signal.SIGKILL)
            killed[0] = time.monotonic()

    async def scenario():
        async with _client(2) as client:
            whole = await _stream(client, cluster.url, _body(1, 20))  # one request, start to end, on TP 2
            assert whole["error"] is None and whole["finish"] == "length" and whole["text"]
            stream = asyncio.create_task(_stream(client, cluster.url, body, kill_rank1_at_chunk_5))
            while victim.poll() is None:
                await asyncio.sleep(0.01)
            exited[0] = time.monotonic() - killed[0]
            await asyncio.get_running_loop().run_in_executor(None, cluster.start_worker, "w-tp1")
            got = await stream
            reference = await _stream(client, cluster.url, body)  # served by w-tp1 alone
            return got, reference

    got, reference = asyncio.run(scenario())
    print(f"\n[tp] rank 1 killed: the worker exited {exited[0]:.2f}s later with {victim.returncode}")
    assert victim.returncode == RANK_DIED and exited[0] < 5
    assert got["error"] is None and got["finish"] == "length"
    assert cluster.fresh_info("w-tp1")["requests_resumed"] == 1
    assert got["text"] == reference["text"], "the resumed text must equal an uninterrupted run"
