"""The reservation policy: a request without max_tokens reserves a default completion, capped at
the context its prompt leaves."""
from __future__ import annotations

from gateway.estimate import completion_tokens, request_tokens

IDS = {"prompt_token_ids": list(range(100))}


def test_max_tokens_is_reserved_as_asked():
    assert request_tokens(IDS, 50, 2, max_model_len=4096, default_completion=1024) == 100 + 2 * 50


def test_without_max_tokens_the_default_is_reserved_per_choice():
    assert request_tokens(IDS, None, 1, max_model_len=40960, default_completion=1024) == 100 + 1024
    assert request_tokens(IDS, None, 3, max_model_len=40960, default_completion=1024) == 100 + 3 * 1024


def test_without_max_tokens_never_more_than_the_context_leaves():
    assert request_tokens(IDS, None, 1, max_model_len=300, default_completion=1024) == 300
    assert completion_tokens(5000, None, 4096, 1024) == 1  # the worker refuses it; settled then


def test_without_a_known_context_the_default_stands():
    assert completion_tokens(100, None, None, 2048) == 2048
    assert completion_tokens(100, None, None, 0) == 0  # 0: the prompt alone, as before
