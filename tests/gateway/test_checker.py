"""The gateway's constraint checker (gateway/checker.py), a real process of its own: a check past its
time bound is killed, not left running; a costly check leaves the event loop free; API keys take
turns, so one key's costly schemas do not hold another key's cheap one; a checker that dies fails
only the checks it held, and the next one starts it again; a check's memory is bounded."""
from __future__ import annotations

import asyncio
import contextlib
import json
import time

import psutil
import pytest

from gateway.checker import Checker
from gateway.structured import Check
from shared.errors import InvalidRequest, InvalidStructuredOutput, Overloaded

SLOW_PATTERN = "(a{1,1000}){1,1000}(b{2,999}){3,998}"  # ~40 ms of xgrammar's front end, each


def _slow(salt: str, n: int = 300) -> Check:
    """A valid schema xgrammar's front end takes seconds over (`pattern`s), distinct per salt."""
    props = {f"{salt}{i}": {"type": "string", "pattern": SLOW_PATTERN} for i in range(n)}
    return Check("json", json.dumps({"type": "object", "properties": props}), "response_format")


def _small(name: str) -> Check:
    return Check("json", json.dumps({"type": "object", "properties": {name: {"type": "integer"}}}),
                 "response_format")


def _busy_children(checker: Checker) -> list[psutil.Process]:
    """The checker's children that are using the CPU (the one forked ahead waits, idle)."""
    children = psutil.Process(checker._process.pid).children()
    for child in children:
        _cpu_percent(child)
    time.sleep(0.3)
    return [c for c in children if _cpu_percent(c) > 20]


def _cpu_percent(process: psutil.Process) -> float:
    """Its CPU use since the last call; 0 once it has exited (a killed child may go between the
    listing and the reading: CI saw NoSuchProcess there)."""
    try:
        return process.cpu_percent()
    except psutil.NoSuchProcess:
        return 0.0


@contextlib.asynccontextmanager
async def _running(timeout_s: float, memory_mb: int = 1024):
    """A checker with one slot, started (its import is not timed), stopped after."""
    checker = Checker(timeout_s, 1, memory_mb)
    try:
        await checker.check([Check("regex", "[a-z]", "warm")], "key")
        yield checker
    finally:
        await checker.stop()


async def _refused(checker: Checker, checks: list[Check], tenant: str = "key") -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        await checker.check(checks, tenant)
    return info.value


async def test_a_check_past_its_time_bound_is_a_400_and_its_child_is_killed():
    async with _running(0.5) as checker:
        err = await _refused(checker, [_small("before"), _slow("a")])
        assert isinstance(err, InvalidStructuredOutput)
        assert err.param == "response_format" and "within 0.5 s" in err.message
        assert not await asyncio.to_thread(_busy_children, checker)
        await checker.check([_small("after")], "key")  # the checker goes on


async def test_a_costly_check_leaves_the_event_loop_free():
    """Before the checker, the meta-check of a body of tools ran on the loop (10 s for 1 MiB)."""
    async with _running(30) as checker:
        slow = asyncio.create_task(checker.check([_slow("b", 60)], "key"))
        gaps, last = [], time.perf_counter()
        while not slow.done():
            await asyncio.sleep(0.01)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
        await slow
        assert sum(gaps) > 1.0 and max(gaps) < 0.25, (sum(gaps), max(gaps))


async def test_keys_take_turns_so_one_keys_costly_checks_do_not_hold_anothers():
    done: list[str] = []

    async def ask(checker: Checker, check: Check, tenant: str, label: str) -> None:
        try:
            await checker.check([check], tenant)
        except InvalidRequest:
            pass
        done.append(label)
    async with _running(0.8) as checker:
        flood = [asyncio.create_task(ask(checker, _slow(f"f{i}_"), "flood", f"flood{i}")) for i in range(4)]
        await asyncio.sleep(0.2)
        await ask(checker, _small("light"), "light", "light")
        await asyncio.gather(*flood)
        # one slot: the flooding key's first check ran, then the light key's turn came
        assert done.index("light") <= 1, done


async def test_a_checker_that_dies_fails_only_the_checks_it_held_and_starts_again():
    async with _running(30) as checker:
        await checker.check([_small("kept")], "key")
        held = asyncio.create_task(checker.check([_slow("c", 120)], "key"))
        await asyncio.sleep(0.3)
        checker._process.kill()
        with pytest.raises(Overloaded):
            await held
        await checker.check([_small("kept")], "key")  # kept from before: answered without it
        await checker.check([_small("new")], "key")  # a new one starts the checker again
        assert checker._process is not None and checker._process.returncode is None


async def test_a_check_needing_more_memory_than_its_bound_is_a_400_naming_it():
    """300 integer ranges take xgrammar's front end some 32–64 MB."""
    props = {f"k{i}": {"type": "integer", "minimum": -(10**17) + i * 7919, "maximum": 10**17 - i}
             for i in range(300)}
    ranges = Check("json", json.dumps({"type": "object", "properties": props}), "guided_json")
    async with _running(30, memory_mb=8) as checker:
        err = await _refused(checker, [ranges])
        assert err.param == "guided_json" and "more than 8 MB" in err.message, err.message
        await checker.check([Check("regex", "[0-9]+", "guided_regex")], "key")  # small enough
