"""The canary's routing, rescue and analysis tests (tests/gateway/test_canary_routing.py,
tests/services/test_canary_analysis.py) again on a real Redis Cluster: the route's compare-and-set
runs apart from the alias index there, and a rescue moves entries between two versions' streams of
one alias (one slot: `{m:<alias>}`)."""
from __future__ import annotations

import pytest
from redis.asyncio.cluster import RedisCluster

from gateway.registry import Registry
from gateway.routing import Router
from tests.gateway.test_canary_routing import (  # noqa: F401 (collected here, with this module's fixtures)
    alias, test_a_rescue_respects_the_target_depth_keeps_the_schema_and_resumes_its_own_reads,
    test_a_route_change_reaches_the_other_replica_within_a_second, test_cohorts_pin_versions,
    test_failover_to_stable_when_the_canary_has_no_live_worker,
    test_requests_queued_for_a_dead_version_move_to_a_live_one,
    test_ten_thousand_keys_split_ten_percent_and_stick)
from tests.services.test_canary_analysis import (  # noqa: F401
    test_a_failing_canary_never_advances, test_failing_success_rate_rolls_back_with_the_reason,
    test_staged_rollout_advances_only_while_passing_and_promotes_at_the_end)

pytestmark = pytest.mark.cluster


@pytest.fixture
async def replicas(redis_cluster):
    clients = [RedisCluster.from_url(redis_cluster.url) for _ in range(2)]
    yield [Router(c, Registry(c), stale_s=3.0) for c in clients]
    for c in clients:
        await c.aclose()


@pytest.fixture
async def client(redis_cluster):
    c = RedisCluster.from_url(redis_cluster.url)
    yield c
    await c.aclose()
