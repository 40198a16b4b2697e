"""Role markers from a chat template: exact for prefix/suffix-shaped templates (ChatML, Llama 3 with
its BOS), None for one that is not, so a client never guesses."""
from __future__ import annotations

import pytest

from worker.engine.chat_markers import chat_markers
from worker.engine.tokenizer import load_tokenizer

LLAMA3 = ("{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' "
          "+ m['content'] + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
PER_ROLE_END = ("{% for m in messages %}{% if m['role'] == 'user' %}[U]{{ m['content'] }}[/U]{% else %}"
                "<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endif %}{% endfor %}")


@pytest.fixture()
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def _chat(markers: dict, messages: list[tuple[str, str]], generation: bool) -> str:
    first = messages[0][0]
    text = markers["system_begin"] if first == "system" else markers["begin"]
    text += "".join(markers["start"][r] + c + markers["end"] for r, c in messages)
    return text + (markers["generation"] if generation else "")


@pytest.mark.parametrize("template", [None, LLAMA3])
def test_markers_rebuild_the_template(tokenizer, template):
    if template:
        tokenizer.chat_template = template
    markers = chat_markers(tokenizer)
    for messages in ([("system", "Be brief."), ("user", "Hi there"), ("assistant", "Hello"), ("user", "Bye")],
                     [("user", "Only a question")]):
        expected = tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in messages], tokenize=False,
                                                 add_generation_prompt=True)
        bos = tokenizer.bos_token or ""
        if template and expected.startswith(bos) and bos and tokenizer.encode("a")[0] == tokenizer.bos_token_id:
            expected = expected[len(bos):]  # the tokenizer adds it to a completion prompt
        assert _chat(markers, messages, True) == expected


def test_a_template_that_ends_roles_differently_has_none(tokenizer):
    tokenizer.chat_template = PER_ROLE_END
    assert chat_markers(tokenizer) is None
    tokenizer.chat_template = None
    assert chat_markers(tokenizer) is None
