"""Engine knobs defined once: each EngineConfig field an operator sets is a WorkerSettings field and a
`kvgate worker` option of the same name, with the same default, and reaches the engine by name. A
knob added to EngineConfig without its setting and option fails here."""
from __future__ import annotations

import dataclasses
import inspect

import pytest

from kvgate.cli import worker as worker_command
from shared.settings import WorkerSettings
from worker.engine.config import NOT_SETTINGS, EngineConfig
from worker.engine.hf_engine import HFEngine
from worker.engine.synthetic import SyntheticEngine
from worker.main import HONOURED, engine_config

KNOBS = [f for f in dataclasses.fields(EngineConfig) if f.name not in NOT_SETTINGS]
OTHER = {"device": "cpu", "dtype": "float32", "attention_backend": "torch", "reasoning_parser": "qwen3",
         "cpu_linear_kernel": "aten", "task": "embed", "score_tokens": "no,yes", "score_template": "pair.jinja"}  # str knobs: another value


def _other(f: dataclasses.Field):
    """A value of the knob other than its default."""
    if f.name in OTHER:
        return OTHER[f.name]
    if isinstance(f.default, bool):
        return not f.default
    if isinstance(f.default, float):
        return f.default / 2
    if f.default is None or isinstance(f.default, int):
        return (f.default or 0) + 3
    raise AssertionError(f"add another value of `{f.name}` to OTHER")


@pytest.mark.parametrize("knob", KNOBS, ids=lambda f: f.name)
def test_each_knob_is_a_setting_with_the_same_default_and_a_worker_option(knob):
    setting = WorkerSettings.model_fields.get(knob.name)
    assert setting is not None, f"EngineConfig.{knob.name} has no WorkerSettings field (or add it to NOT_SETTINGS)"
    assert setting.default == knob.default, f"{knob.name}: setting {setting.default!r} vs engine {knob.default!r}"
    options = {p.name for p in worker_command.params}
    assert knob.name in options, f"`kvgate worker` has no option for {knob.name}"


def test_settings_reach_the_engine_config_by_name(tmp_path):
    given = {f.name: _other(f) for f in KNOBS}
    config = engine_config(WorkerSettings(model=str(tmp_path), **given))
    assert config.model_dir == str(tmp_path)
    assert {name: getattr(config, name) for name in given} == given


def test_worker_options_are_named_as_the_settings_they_override(tmp_path):
    """`kvgate worker` passes the options it was given to WorkerSettings by name."""
    args = ["--model", str(tmp_path), "--no-prefix-caching", "--enforce-eager", "--max-num-seqs", "5",
            "--attention-backend", "torch"]
    params = worker_command.make_context("worker", args).params
    assert {k: params[k] for k in ("enable_prefix_caching", "enforce_eager", "max_num_seqs",
                                   "attention_backend")} == {
        "enable_prefix_caching": False, "enforce_eager": True, "max_num_seqs": 5, "attention_backend": "torch"}
    unset = worker_command.make_context("worker", ["--model", str(tmp_path)]).params
    assert all(unset[f.name] is None for f in KNOBS), "an option not given leaves the setting (or env) alone"


@pytest.mark.parametrize("engine, cls", [("hf", HFEngine), ("synthetic", SyntheticEngine)])
def test_the_other_engines_take_their_knobs_from_the_same_config(engine, cls):
    accepted = inspect.signature(cls.from_model_dir).parameters
    for name in HONOURED[engine]:
        assert name in {f.name for f in KNOBS} and name in accepted, f"{engine}: {name}"


def test_the_linear_kernel_option_offers_every_path():
    from worker.models.linear import PATHS

    option = next(p for p in worker_command.params if p.name == "cpu_linear_kernel")
    assert set(option.type.choices) == {"auto", *PATHS}
