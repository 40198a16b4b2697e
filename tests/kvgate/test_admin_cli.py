"""The admin CLI's own behaviour, without a gateway: where it finds the URL and key, and that every
failure is one clear line rather than a traceback. (Against a live stack: tests/integration.)"""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from kvgate.cli import main

DEAD_URL = "http://127.0.0.1:9"  # the discard port: nothing listens


@pytest.fixture
def run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("KVGATE_URL", raising=False)
    monkeypatch.delenv("KVGATE_ADMIN_KEY", raising=False)

    def invoke(*args: str, env: dict | None = None):
        result = CliRunner().invoke(main, list(args), env=env)
        assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
        return result
    return invoke


def test_without_url_it_says_where_a_url_comes_from(run):
    result = run("keys", "list")
    assert result.exit_code == 1 and "--url" in result.output and "KVGATE_URL" in result.output


def test_without_admin_key_it_says_where_one_comes_from(run):
    result = run("keys", "list", "--url", DEAD_URL)
    assert result.exit_code == 1 and "KVGATE_ADMIN_KEY" in result.output


def test_unreachable_gateway_is_one_line(run):
    result = run("usage", "--url", DEAD_URL, "--admin-key", "k")
    assert result.exit_code == 1 and f"cannot reach the gateway at {DEAD_URL}" in result.output


def test_state_files_and_env_are_read(run, tmp_path):
    state = tmp_path / ".kvgate"
    state.mkdir()
    (state / "gateway.url").write_text(DEAD_URL + "\n")
    (state / "admin.key").write_text("sk-kvg-admin\n")
    assert f"cannot reach the gateway at {DEAD_URL}" in run("keys", "show", "alice").output
    other = "http://127.0.0.1:7"
    assert f"at {other}" in run("keys", "list", env={"KVGATE_URL": other}).output


def test_bad_durations_are_usage_errors(run):
    result = run("keys", "create", "--name", "a", "--expires", "soon", "--url", DEAD_URL,
                 "--admin-key", "k")
    assert result.exit_code == 2 and "--expires" in result.output


def test_update_needs_something_to_change(run):
    result = run("keys", "update", "alice", "--url", DEAD_URL, "--admin-key", "k")
    assert result.exit_code == 2 and "nothing to change" in result.output
