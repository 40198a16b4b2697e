"""What the canary analysis and the TTFT metric count as a first token: not the admission verdict."""
from __future__ import annotations

import time

from gateway.routing import Outcome
from shared import protocol


def test_the_admission_verdict_is_not_the_first_token():
    outcome = Outcome("chat", "v2", window_s=60)
    outcome.saw(protocol.Delta(request_id="r", seq=1))
    assert outcome.first is None and outcome.ttft_ms() is None
    time.sleep(0.01)
    outcome.saw(protocol.Delta(request_id="r", seq=2, text="Hi", token_ids=[11]))
    outcome.saw(protocol.Delta(request_id="r", seq=3, token_ids=[12]))  # text held back
    assert outcome.ttft_ms() >= 10 and outcome.tokens == {0: 2}


def test_a_failure_a_retry_cured_is_still_the_versions():
    from shared.errors import EngineFailure

    canary = Outcome("chat", "v2", window_s=60)  # failed on v2, retried on v1, which finished it
    canary.absorbed("v2", EngineFailure("boom"))
    canary.saw(protocol.Done(request_id="r-r1", seq=5, prompt_tokens=3, completion_tokens=2))
    assert canary.ok is False
    other = Outcome("chat", "v1", window_s=60)  # a failure of another version is not this one's
    other.absorbed("v2", EngineFailure("boom"))
    other.saw(protocol.Done(request_id="r", seq=5, prompt_tokens=3, completion_tokens=2))
    assert other.ok is True
