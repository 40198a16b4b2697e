import redis

from shared.redis_server import RedisServer, find_redis_server


def test_launcher_starts_a_real_server_on_loopback_and_stops_it():
    assert find_redis_server()
    server = RedisServer().start()
    try:
        client = redis.Redis.from_url(server.url)
        assert client.ping()
        assert client.config_get("bind")["bind"].startswith("127.0.0.1")
        client.xadd("s", {"a": 1})
        assert client.xlen("s") == 1
    finally:
        server.stop()
    assert server.proc.poll() is not None
