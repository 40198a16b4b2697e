"""check_finish: stop ids and eos (unless ignored) stop past the first min_tokens tokens, then length."""
from worker.engine.stopping import check_finish
from worker.engine.types import SamplingParams

EOS = {2, 7}


def test_eos_stops():
    assert check_finish(7, 1, SamplingParams(), EOS) == "stop"


def test_ordinary_token_continues_until_max_tokens():
    params = SamplingParams(max_tokens=3)
    assert check_finish(11, 2, params, EOS) is None
    assert check_finish(11, 3, params, EOS) == "length"


def test_stop_token_ids_stop_even_at_the_length_limit():
    assert check_finish(11, 3, SamplingParams(max_tokens=3, stop_token_ids=[11]), EOS) == "stop"


def test_eos_ignored_below_min_tokens_or_with_ignore_eos():
    assert check_finish(2, 3, SamplingParams(min_tokens=3), EOS) is None
    assert check_finish(2, 4, SamplingParams(min_tokens=3), EOS) == "stop"
    assert check_finish(2, 1, SamplingParams(ignore_eos=True), EOS) is None
    assert check_finish(2, 16, SamplingParams(ignore_eos=True), EOS) == "length"


def test_a_stop_id_among_the_first_min_tokens_tokens_does_not_stop():
    """The sampler lets one through there only where a grammar allows nothing else: it is text."""
    params = SamplingParams(min_tokens=3, stop_token_ids=[11])
    assert [check_finish(11, n, params, EOS) for n in (1, 2, 3, 4)] == [None, None, None, "stop"]
    assert check_finish(11, 3, SamplingParams(max_tokens=3, min_tokens=3, stop_token_ids=[11]), EOS) == "length"
