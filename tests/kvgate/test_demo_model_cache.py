"""The demo model is built once into the user's cache; two processes building it at once (two
`kvgate up`, or two test processes) both end up serving the one folder, neither failing."""
from __future__ import annotations

import json

from kvgate import up


def _fake_build(path, **_):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"built_by": path.name}))


def test_a_process_that_finishes_second_serves_the_folder_the_first_built(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cache = tmp_path / "kvgate" / "demo-model-v2"

    def built_meanwhile(path, **kw):  # another process's build lands while this one builds
        _fake_build(cache)
        _fake_build(path)

    monkeypatch.setattr("worker.models.demo.build_model_dir", built_meanwhile)
    assert up.default_model_dir() == cache
    assert json.loads((cache / "config.json").read_text()) == {"built_by": "demo-model-v2"}
    assert [p.name for p in cache.parent.iterdir()] == ["demo-model-v2"]  # its own copy removed


def test_the_first_build_is_moved_into_place(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr("worker.models.demo.build_model_dir", _fake_build)
    cache = up.default_model_dir()
    assert (cache / "config.json").exists() and [p.name for p in cache.parent.iterdir()] == ["demo-model-v2"]
