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
