import os

import pytest
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


def test_a_password_is_required_and_never_on_the_command_line():
    import socket

    password = 'p@ss "word" \\ with: odd/chars'
    with RedisServer(password=password) as server:
        assert redis.Redis.from_url(server.url).ping()  # the URL carries it
        with socket.create_connection(("127.0.0.1", server.port), timeout=2) as raw:
            raw.sendall(b"PING\r\n")
            assert raw.recv(100).startswith(b"-NOAUTH")
        with open(f"/proc/{server.proc.pid}/cmdline", "rb") as cmdline:
            assert password.encode() not in cmdline.read()


def test_kvgate_redis_server_names_the_binary(tmp_path, monkeypatch):
    """KVGATE_REDIS_SERVER picks the server (the soak runs on a jemalloc build with it)."""
    monkeypatch.delenv("KVGATE_REDIS_SERVER", raising=False)
    linked = tmp_path / "bin" / "redis-server"
    linked.parent.mkdir()
    os.symlink(find_redis_server(), linked)
    monkeypatch.setenv("KVGATE_REDIS_SERVER", str(linked))
    assert find_redis_server() == str(linked)
    with RedisServer() as server:
        assert server.proc.args[0] == str(linked)
        assert redis.Redis.from_url(server.url).ping()
    monkeypatch.setenv("KVGATE_REDIS_SERVER", str(tmp_path / "missing"))
    with pytest.raises(RuntimeError, match="KVGATE_REDIS_SERVER"):
        find_redis_server()
