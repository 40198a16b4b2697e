"""The key store's own tests (tests/gateway/test_keystore.py) again on a real Redis Cluster, where
creation, lookup, rename and rotation run as per-slot steps (docs/redis-keys.md): names stay unique,
one secret stays current, a revoke is never undone, with many writers at once."""
from __future__ import annotations

import pytest
from redis.asyncio.cluster import RedisCluster

from gateway.keystore import KeyStore
from tests.gateway.test_keystore import (  # noqa: F401 (collected here, with this module's `store`)
    test_a_record_stored_before_cache_scope_reads_its_isolation,
    test_concurrent_renames_to_one_name_leave_it_unique,
    test_concurrent_rotations_leave_one_current_secret,
    test_concurrent_rotations_without_grace_leave_only_the_current_secret,
    test_create_lookup_and_unique_names, test_rotate_without_grace_drops_the_old_secret_at_once,
    test_unknown_names_are_404, test_update_racing_revoke_never_reactivates)

pytestmark = pytest.mark.cluster


@pytest.fixture
async def store(redis_cluster):
    client = RedisCluster.from_url(redis_cluster.url, max_connections=200)
    yield KeyStore(client, "server-secret")
    await client.aclose()
