"""The bundled score templates render what their model cards say a pair looks like."""
import pytest

from worker.engine.tokenizer import encode_pair
from worker.models.demo import train_tokenizer
from worker.models.pooling import read_score_template

# Qwen3-Reranker's model card: its prompt around "<Instruct>: …\n<Query>: …\n<Document>: …"
QWEN3_PREFIX = ('<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the '
                'Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n')
QWEN3_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
QWEN3_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


def test_qwen3_reranker_template_renders_the_model_cards_prompt(tokenizer):
    query, document = "What is Redis?", "An in-memory data store.\nIt keeps keys."
    ids = encode_pair(tokenizer, query, document, read_score_template("qwen3_reranker"))
    card = f"{QWEN3_PREFIX}<Instruct>: {QWEN3_INSTRUCTION}\n<Query>: {query}\n<Document>: {document}{QWEN3_SUFFIX}"
    assert tokenizer.decode(ids) == card
    assert ids == tokenizer.encode(card, add_special_tokens=False)  # its markers as the special tokens they are


def test_a_template_is_a_file_or_a_bundled_name(tmp_path):
    mine = tmp_path / "mine.jinja"
    mine.write_text("{{ messages[0].content }}|{{ messages[1].content }}")
    assert read_score_template(str(mine)) == mine.read_text()
    with pytest.raises(ValueError, match="qwen3_reranker"):  # the error lists the bundled ones
        read_score_template("qwen4_reranker")
