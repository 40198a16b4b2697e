"""One Redis Cluster (3 primaries + 3 replicas, ~2 s to start) for the store-level cluster tests."""
from __future__ import annotations

import pytest

from shared.redis_server import RedisClusterServers


@pytest.fixture(scope="session")
def redis_cluster():
    servers = RedisClusterServers().start()
    yield servers
    servers.stop()
