"""Rerankers from the paged engine score each (query, document) pair as transformers does: a
sequence-classification folder by the sigmoid of its one logit, a causal LM by its answer tokens'
logits (P(yes) of "no", "yes"; the sigmoid of one token's) — the pair rendered by the tokenizer or a
score template, however its inputs are chunked, batched or read from the prefix cache; and each
folder, task and request the engine cannot serve is refused by name."""
from __future__ import annotations

import json
import random
import shutil
from functools import cache

import pytest
import torch

from worker.engine import pooling
from worker.engine.llm import LLM
from worker.engine.tokenizer import encode_pair, load_tokenizer
from worker.engine.types import EngineRejected, SamplingParams
from worker.models.pooling import Pooling, read_pooling

from .conftest import TINY

QWEN3 = dict(TINY, head_dim=16)  # Qwen3Config's own head_dim is 128
NO, YES = "Ġno", "Ġvery"  # answer tokens the demo tokenizer has ("yes" is not one of its tokens)
WORDS = ("the water people number sound little place time model token cache block stream worker gateway "
         "request good very word been find work where after back").split()

# Qwen3-Reranker's prompt, as a score template file gives it (vLLM's: messages of roles "query" and
# "document"); jinja drops a template's last newline, so a comment ends it after the blank line
SCORE_TEMPLATE = """\
{%- set query = messages | selectattr('role', 'eq', 'query') | map(attribute='content') | first -%}
{%- set document = messages | selectattr('role', 'eq', 'document') | map(attribute='content') | first -%}
<|im_start|>system
Judge whether the Document meets the requirements based on the Query. Answer only "yes" or "no".<|im_end|>
<|im_start|>user
<Instruct>: Given a web search query, retrieve relevant passages that answer the query
<Query>: {{ query }}
<Document>: {{ document }}<|im_end|>
<|im_start|>assistant
<think>

</think>

{# the end #}
"""


def rendered(query: str, document: str) -> str:
    """SCORE_TEMPLATE's text for one pair, written out by hand."""
    return ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query. Answer only "
            f'"yes" or "no".<|im_end|>\n<|im_start|>user\n<Instruct>: Given a web search query, retrieve relevant '
            f"passages that answer the query\n<Query>: {query}\n<Document>: {document}<|im_end|>\n"
            "<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Qwen3-Reranker-seq-cls-like folders (a one-label `score` head) of two archs, and a causal Qwen3
    to score by its answer tokens (the original Qwen3-Reranker's way)."""
    from worker.models.demo import build_reranker_dir

    root = tmp_path_factory.mktemp("rerankers")
    return dict(qwen3=build_reranker_dir(root / "qwen3", **QWEN3),
                llama=build_reranker_dir(root / "llama", arch="llama", **TINY),
                causal=build_reranker_dir(root / "causal", classifier=False, **QWEN3))


def make_pairs(n: int, seed: int, query=(1, 12), document=(1, 40)) -> list[tuple[str, str]]:
    rng = random.Random(seed)

    def text(lo, hi):
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))
    return [(text(*query), text(*document)) for _ in range(n)]


@cache
def _hf(folder, classifier: bool):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    cls = AutoModelForSequenceClassification if classifier else AutoModelForCausalLM
    return cls.from_pretrained(str(folder), dtype=torch.float32).eval()


def pair_ids(folder, pairs) -> list[list[int]]:
    """transformers' own pair encoding, `tokenizer(q, d)` (vLLM's cross-encoding without a template)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    return [tokenizer(q, d)["input_ids"] for q, d in pairs]


@torch.inference_mode()
def classifier_scores(folder, inputs: list[list[int]]) -> list[float]:
    """The sigmoid of transformers' one logit, one input at a time (no padding)."""
    model = _hf(folder, True)
    return [torch.sigmoid(model(torch.tensor([ids])).logits[0, 0]).item() for ids in inputs]


@torch.inference_mode()
def answer_scores(folder, inputs: list[list[int]], tokens: tuple[str, ...]) -> list[float]:
    """transformers' causal LM at the last position: the softmax of the two answer tokens' logits,
    the second's share (P(yes)), or the sigmoid of the one token's logit."""
    from transformers import AutoTokenizer

    model = _hf(folder, False)
    token_ids = AutoTokenizer.from_pretrained(str(folder)).convert_tokens_to_ids(list(tokens))
    scores = []
    for ids in inputs:
        logits = model(torch.tensor([ids])).logits[0, -1, token_ids]
        scores.append((torch.softmax(logits, 0)[1] if len(tokens) == 2 else torch.sigmoid(logits[0])).item())
    return scores


def close(got: list[float], want: list[float], spread: float = 0.05) -> None:
    """fp32 to 1e-4 (a wrong head, sign or token is off by ~0.1; the RoPE table's cos and sin are
    taken in float64 on the CPU, which took away a ~2e-4 error one process in six had)."""
    assert len(got) == len(want)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-4, rtol=0)
    assert max(want) - min(want) > spread


def edited(src, dst, **changes):
    """A copy of the folder with `changes` written into its config.json."""
    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**raw, **changes}))
    return dst


@pytest.mark.parametrize("name", ["qwen3", "llama"])
def test_a_score_head_folder_scores_as_transformers(folders, name):
    pairs = make_pairs(8, seed=1)
    llm = LLM(folders[name], block_size=8, dtype="float32")
    assert llm.engine.task == "score" and read_pooling(folders[name]) == Pooling("last", False, score_tokens=())
    close(llm.score(pairs), classifier_scores(folders[name], pair_ids(folders[name], pairs)))


@pytest.mark.parametrize("tokens", [(NO, YES), (YES,)])
def test_answer_tokens_score_a_causal_lm_as_transformers(folders, tokens):
    folder, pairs = folders["causal"], make_pairs(8, seed=2)
    assert set(tokens) <= load_tokenizer(folder).get_vocab().keys()
    llm = LLM(folder, block_size=8, dtype="float32", task="score", score_tokens=",".join(tokens))
    close(llm.score(pairs), answer_scores(folder, pair_ids(folder, pairs), tokens))


def test_classifier_from_token_in_the_config_names_the_answer_tokens(folders, tmp_path):
    folder, pairs = edited(folders["causal"], tmp_path / "from-token", classifier_from_token=[NO, YES]), make_pairs(6, 3)
    assert read_pooling(folder, "score") == Pooling("last", False, score_tokens=(NO, YES))
    assert read_pooling(folder) is None  # auto: a causal LM generates unless told to score
    llm = LLM(folder, block_size=8, dtype="float32", task="score")
    close(llm.score(pairs), answer_scores(folders["causal"], pair_ids(folder, pairs), (NO, YES)))


def test_a_score_template_renders_each_pair(folders, tmp_path):
    """Qwen3-Reranker's prompt: its <|im_start|> markers are special tokens, placed as one id each."""
    folder, pairs = folders["causal"], make_pairs(6, seed=4)
    (tmp_path / "score.jinja").write_text(SCORE_TEMPLATE)
    llm = LLM(folder, block_size=8, dtype="float32", task="score", score_tokens=f"{NO},{YES}",
              score_template=str(tmp_path / "score.jinja"))
    assert llm.engine.score_template == SCORE_TEMPLATE
    tokenizer = llm.engine.tokenizer
    inputs = [tokenizer.encode(rendered(q, d), add_special_tokens=False) for q, d in pairs]
    assert [encode_pair(tokenizer, q, d, SCORE_TEMPLATE) for q, d in pairs] == inputs
    assert all(ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3 for ids in inputs)
    close(llm.score(pairs), answer_scores(folder, inputs, (NO, YES)), spread=0.01)  # one suffix ends them all


def test_pairs_longer_than_a_step_are_chunked(folders):
    folder, pairs = folders["qwen3"], make_pairs(5, seed=5, query=(10, 20), document=(20, 60))
    inputs = pair_ids(folder, pairs)
    assert min(map(len, inputs)) > 16
    llm = LLM(folder, block_size=8, max_num_batched_tokens=16, dtype="float32")
    close(llm.score(pairs), classifier_scores(folder, inputs))


def test_a_shared_query_is_read_from_the_prefix_cache(folders):
    """Scores with the query's blocks from the cache are the scores without them."""
    folder = folders["qwen3"]
    [(query, _)] = make_pairs(1, seed=6, query=(40, 40))
    pairs = [(query, d) for _, d in make_pairs(12, seed=7)]
    cached = LLM(folder, block_size=8, max_num_batched_tokens=64, dtype="float32")
    uncached = LLM(folder, block_size=8, max_num_batched_tokens=64, dtype="float32", enable_prefix_caching=False)
    got = cached.score(pairs)
    assert cached.engine.pool.num_hits >= (len(pairs) - 1) * 32  # the query's full blocks, pair after pair
    close(got, classifier_scores(folder, pair_ids(folder, pairs)))
    close(uncached.score(pairs), got)
    assert uncached.engine.pool.num_hits == 0


def test_forty_pairs_come_back_in_order_sixteen_at_a_time(folders):
    folder, pairs = folders["qwen3"], make_pairs(40, seed=8)
    llm = LLM(folder, block_size=8, max_num_seqs=64, dtype="float32")
    engine, schedule, seen = llm.engine, llm.engine.scheduler.schedule, []

    def watched():
        seen.append(len(engine.scheduler.waiting) + len(engine.scheduler.running))
        return schedule()
    engine.scheduler.schedule = watched
    close(llm.score(pairs), classifier_scores(folder, pair_ids(folder, pairs)))
    assert max(seen) == pooling.AT_ONCE
    assert not engine.requests and engine.pool.num_free_blocks == engine.pool.num_blocks


@pytest.mark.parametrize("name,task,changes,message", [
    ("qwen3", "generate", {}, "is a sequence-classification folder \\(Qwen3ForSequenceClassification\\): it has "
                              "no LM head"),
    ("qwen3", "auto", dict(id2label={"0": "no", "1": "yes"}), "config.json has 2 labels: a reranker has one"),
    ("qwen3", "score", dict(num_labels=3), "config.json has 3 labels"),
    ("causal", "score", {}, "task score on .* \\(Qwen3ForCausalLM\\) needs its answer tokens: --score-tokens"),
    ("causal", "score", dict(classifier_from_token=[NO, YES, "Ġword"]), "got \\['Ġno', 'Ġvery', 'Ġword'\\]"),
    ("causal", "score", dict(classifier_from_token=[NO, YES], final_logit_softcapping=30.0),
     "config.json sets final_logit_softcapping 30.0: its logits are not the LM head's rows"),
    ("causal", "score", dict(classifier_from_token=[YES], logits_scaling=2.0), "sets logits_scaling 2.0"),
    ("causal", "score", dict(classifier_from_token=[YES], logit_scale=0.5), "sets logit_scale 0.5"),
])
def test_a_folder_no_score_can_be_read_from_is_refused_by_name(folders, tmp_path, name, task, changes, message):
    folder = edited(folders[name], tmp_path / "folder", **changes)
    with pytest.raises(ValueError, match=message):
        read_pooling(folder, task)
    with pytest.raises(ValueError, match=message):
        LLM(folder, block_size=8, dtype="float32", task=task)


def test_scales_that_leave_the_logits_as_they_are_are_served(folders, tmp_path):
    folder = edited(folders["causal"], tmp_path / "folder", classifier_from_token=[YES], logits_scaling=1,
                    logit_scale=1.0, final_logit_softcapping=None)
    assert read_pooling(folder, "score") == Pooling("last", False, score_tokens=(YES,))


@pytest.mark.parametrize("tokens,message", [
    ("no,yes", "score token 'no' is not one token of .*'s tokenizer"),
    (f"{NO},{YES},Ġword", "needs its answer tokens: .* got \\['Ġno', 'Ġvery', 'Ġword'\\]"),
])
def test_answer_tokens_the_tokenizer_cannot_score_are_refused(folders, tokens, message):
    with pytest.raises(ValueError, match=message):
        LLM(folders["causal"], block_size=8, dtype="float32", task="score", score_tokens=tokens)


def test_each_engine_serves_only_its_task(folders):
    params = SamplingParams(max_tokens=1)
    scorer = LLM(folders["qwen3"], block_size=8, dtype="float32").engine
    with pytest.raises(EngineRejected, match="is a reranker \\(/v1/score, /v1/rerank\\); it does not serve embeddings"):
        scorer.add_embedding("r", [[5, 6]], params)
    with pytest.raises(EngineRejected, match="this model is a reranker: it serves /v1/score and /v1/rerank, not generation"):
        scorer.add_request("r", [5, 6], params)
    embedder = LLM(folders["causal"], block_size=8, dtype="float32", task="embed").engine
    generator = LLM(folders["causal"], block_size=8, dtype="float32").engine
    assert (embedder.task, generator.task) == ("embed", "generate")
    with pytest.raises(EngineRejected, match="is an embedding model \\(/v1/embeddings\\); it does not serve scores"):
        embedder.add_scoring("r", [[5, 6]], params)
    with pytest.raises(EngineRejected, match="generates text; it does not serve scores"):
        generator.add_scoring("r", [[5, 6]], params)
    assert not scorer.requests and not embedder.requests and not generator.requests


def test_each_bound_on_a_scoring_request_is_refused_by_name(folders):
    llm = LLM(folders["qwen3"], block_size=8, max_model_len=64, dtype="float32")
    engine, params = llm.engine, SamplingParams(max_tokens=1)
    for prompts, words in [
        ([], "0 pairs; a request scores 1 to 2048"),
        ([[5, 6]] * (pooling.MAX_INPUTS + 1), "2049 pairs; a request scores 1 to 2048"),
        ([[5] * 65], "pair 0 has 65 tokens; this model's maximum context length is 64"),
        ([[5, 6], []], "pair 1 has 0 tokens"),
        ([[5, engine.vocab_size]], f"pair token id {engine.vocab_size} at position 1 is outside this model's"),
        ([[5, 6], [7, -1]], "pair 1's token id -1 at position 1 is outside"),
    ]:
        with pytest.raises(EngineRejected, match=words):
            engine.add_scoring("r", prompts, params)
    assert not engine.requests and not engine.embedding_queue
    engine.add_scoring("r", [[5] * 64] * pooling.MAX_INPUTS, params)  # the bounds themselves are served
    engine.abort("r")


def test_without_a_template_a_pair_is_the_tokenizers_pair_encoding(folders):
    tokenizer, pairs = load_tokenizer(folders["qwen3"]), make_pairs(4, seed=9)
    joined = [tokenizer(q + d)["input_ids"] for q, d in pairs]  # what one text would be
    assert [encode_pair(tokenizer, q, d) for q, d in pairs] == [tokenizer(q, d)["input_ids"] for q, d in pairs] != joined


@pytest.mark.parametrize("template,words", [
    ("{{ no_such_function('x') }}", "cannot be rendered: 'no_such_function' is undefined"),
    ("{{ raise_exception('documents only') }}", "cannot be rendered: documents only"),
    ("{{ messages[2]['content'] }}", "cannot be rendered"),
])
def test_a_template_that_fails_refuses_the_pair(folders, template, words):
    tokenizer = load_tokenizer(folders["causal"])
    with pytest.raises(EngineRejected, match=words):
        encode_pair(tokenizer, "query", "document", template)


def test_a_failing_template_refuses_the_request_not_the_engine(folders, tmp_path):
    (tmp_path / "bad.jinja").write_text("{{ no_such_function('x') }}")
    llm = LLM(folders["causal"], block_size=8, dtype="float32", task="score", score_tokens=f"{NO},{YES}",
              score_template=str(tmp_path / "bad.jinja"))
    with pytest.raises(EngineRejected, match="cannot be rendered"):
        llm.score([("query", "document")])
    assert not llm.engine.has_unfinished()
