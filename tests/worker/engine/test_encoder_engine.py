"""The encoder engine (worker/engine/encoder.py): BERT and XLM-RoBERTa folders embed and score as
transformers computes them, a step at a time under a padded token budget, each request in turn."""
import pytest
import torch
import transformers

from worker.engine.encoder import EncoderEngine
from worker.engine.llm import LLM
from worker.engine.types import EngineRejected, SamplingParams
from worker.models.demo import build_encoder_dir

TEXTS = ["a cat is a small animal", "paris is in france and it is big", "hello",
         "the very long text of words " * 8, "one more input"]
QUERY = "what is a cat"
PARAMS = SamplingParams(max_tokens=1)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("encoders")
    made = {}
    for kind in ("bert", "xlm-roberta"):
        for pooling in ("cls", "mean_tokens"):
            made[kind, pooling] = build_encoder_dir(root / f"{kind}-{pooling}", kind=kind, pooling=pooling)
        made[kind, "cross"] = build_encoder_dir(root / f"{kind}-cross", kind=kind, classifier=True)
    made["labels3"] = build_encoder_dir(root / "labels3", kind="bert", classifier=True, num_labels=3)
    made["bare"] = build_encoder_dir(root / "bare", kind="bert", pooling=None)
    return made


def _vectors(folder, pooling: str) -> list[torch.Tensor]:
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModel.from_pretrained(folder, dtype=torch.float32)
    out = []
    for text in TEXTS:
        hidden = model(**tok(text, return_tensors="pt")).last_hidden_state[0]
        out.append(torch.nn.functional.normalize(hidden[0] if pooling == "cls" else hidden.mean(0), dim=0))
    return out


@pytest.mark.parametrize("kind", ["bert", "xlm-roberta"])
@pytest.mark.parametrize("pooling", ["cls", "mean_tokens"])
def test_embeddings_agree_with_transformers_across_steps(folders, kind, pooling):
    folder = folders[kind, pooling]
    llm = LLM(folder, max_model_len=96)  # steps of 8 x 96 tokens, padding counted: 20 inputs take several
    steps = []
    step = llm.engine.step
    llm.engine.step = lambda: steps.append(step()) or steps[-1]
    got = llm.embed(TEXTS * 4)
    assert sum(1 for outputs in steps if outputs) >= 2
    for vector, want in zip(got, _vectors(folder, pooling) * 4):
        assert torch.allclose(torch.tensor(vector), want, atol=1e-5)


def test_a_bare_bert_folder_embeds_by_its_cls_token_normalized(folders):
    got = LLM(folders["bare"]).embed(TEXTS[:2])
    for vector, want in zip(got, _vectors(folders["bare"], "cls")):
        assert torch.allclose(torch.tensor(vector), want, atol=1e-5)


@pytest.mark.parametrize("kind", ["bert", "xlm-roberta"])
def test_cross_encoder_scores_agree_with_transformers(folders, kind):
    folder = folders[kind, "cross"]
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32)
    want = [torch.sigmoid(model(**tok(QUERY, text, return_tensors="pt")).logits[0, 0]).item() for text in TEXTS]
    got = LLM(folder, max_num_batched_tokens=64).score([(QUERY, text) for text in TEXTS])
    assert got == pytest.approx(want, abs=1e-5)
    assert max(got) - min(got) > 1e-3  # the scores tell the pairs apart


def test_bert_pairs_take_token_type_1_after_the_first_separator(folders):
    """BERT's token types matter: without them the scores differ from transformers'."""
    folder = folders["bert", "cross"]
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32)
    enc = tok(QUERY, TEXTS[0], return_tensors="pt")
    with_types = torch.sigmoid(model(**enc).logits[0, 0]).item()
    untyped = torch.sigmoid(model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits[0, 0]).item()
    assert abs(with_types - untyped) > 1e-4  # (else this test would show nothing)
    assert LLM(folder).score([(QUERY, TEXTS[0])])[0] == pytest.approx(with_types, abs=1e-5)


def _run(engine: EncoderEngine) -> list:
    steps = []
    while engine.has_unfinished():
        steps.append(engine.step())
    return steps


def test_requests_take_turns_within_a_step(folders):
    # a step's budget is at least one input of the context's length: shorten the context so it binds
    engine = EncoderEngine.from_model_dir(folders["bert", "cls"], max_num_batched_tokens=64, max_model_len=16)
    ids = [engine.tokenizer.encode(t) for t in TEXTS[:3]]
    engine.add_embedding("big", ids * 10, PARAMS)
    engine.add_embedding("small", ids[:1], PARAMS)
    first = engine.step()
    assert ("small", 0) in {(out.request_id, out.index) for out in first}  # not behind big's 30 inputs
    rest = _run(engine)
    answered = [out for step in [first, *rest] for out in step]
    assert sorted(out.index for out in answered if out.request_id == "big") == list(range(30))
    assert all(out.finish_reason == "stop" and len(out.embedding) == 4 * 64 for out in answered)
    assert all(len(step) >= 1 for step in rest) and len(rest) >= 2  # the budget split the work


def test_abort_and_takeover_skip(folders):
    engine = EncoderEngine.from_model_dir(folders["bert", "cls"], max_num_batched_tokens=32, max_model_len=64)
    ids = [engine.tokenizer.encode(t) for t in TEXTS]
    engine.add_embedding("r", ids, PARAMS, finished={0, 2})  # a worker that stopped answered these
    first = engine.step()
    engine.abort("r")
    rest = [out for step in _run(engine) for out in step]
    answered = {out.index for out in first}
    assert answered and answered <= {1, 3, 4}
    assert {out.index for out in rest} == {1, 3, 4} - answered
    assert all(out.finish_reason == "abort" and out.embedding is None for out in rest)
    assert not engine.has_unfinished() and not engine.open


def test_a_failed_step_ends_each_of_its_requests_once_with_a_retryable_error(folders, monkeypatch):
    engine = EncoderEngine.from_model_dir(folders["bert", "cls"])
    ids = [engine.tokenizer.encode(t) for t in TEXTS[:3]]
    engine.add_embedding("a", ids, PARAMS)
    engine.add_embedding("b", ids[:1], PARAMS)

    def broken(*args):
        raise RuntimeError("device lost")
    monkeypatch.setattr(engine, "model", broken)
    outputs = engine.step()
    assert sorted(out.request_id for out in outputs) == ["a", "b"]
    assert all(out.error.retryable and out.finish_reason == "error" for out in outputs)
    assert not engine.has_unfinished()


def test_refusals_name_what_is_wrong(folders):
    embedder = EncoderEngine.from_model_dir(folders["bert", "cls"])
    cross = EncoderEngine.from_model_dir(folders["bert", "cross"])
    ok = embedder.tokenizer.encode("hello")
    with pytest.raises(EngineRejected, match="not generation"):
        embedder.add_request("g", ok, PARAMS)
    with pytest.raises(EngineRejected, match="does not score"):
        embedder.add_scoring("s", [ok], PARAMS)
    with pytest.raises(EngineRejected, match="does not serve embeddings"):
        cross.add_embedding("e", [ok], PARAMS)
    with pytest.raises(EngineRejected, match="maximum context length is 512"):
        embedder.add_embedding("long", [ok * 200], PARAMS)
    with pytest.raises(EngineRejected, match="outside this model's vocabulary"):
        embedder.add_embedding("oov", [[embedder.vocab_size]], PARAMS)
    with pytest.raises(EngineRejected, match="2049 pairs"):
        cross.add_scoring("many", [ok] * 2049, PARAMS)
    assert not embedder.has_unfinished() and not cross.has_unfinished()


@pytest.mark.parametrize("name, overrides, words", [
    ("labels3", {}, "3 labels"),
    (("bert", "cls"), {"task": "score"}, "without a classification head"),
    (("bert", "cls"), {"task": "generate"}, "does not generate"),
    (("bert", "cls"), {"tensor_parallel_size": 2}, "one device"),
])
def test_folders_and_settings_it_cannot_serve_are_refused_at_start(folders, name, overrides, words):
    with pytest.raises(ValueError, match=words):
        EncoderEngine.from_model_dir(folders[name], **overrides)
