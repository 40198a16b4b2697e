"""Structured outputs in the paged engine, on the tiny random model: random weights write valid JSON,
regexes and choices only because the grammar masks every other token."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from shared.sampling import StructuredOutputs
from worker.engine.constraint import Constraint, MatchingMeter, ThinkMarkers, think_markers
from worker.engine.engine import LLMEngine
from worker.engine.types import EngineRejected, Resume, SamplingParams

PROMPT = [5, 17, 301, 42, 999, 7]
SCHEMAS = {
    "person": {
        "type": "object", "additionalProperties": False, "required": ["name", "age", "role"],
        "properties": {"name": {"type": "string", "maxLength": 8},
                       "age": {"type": "integer", "minimum": 0, "maximum": 150},
                       "role": {"enum": ["admin", "user", "guest"]}},
    },
    "order": {
        "type": "object", "additionalProperties": False, "required": ["id", "items", "paid"],
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 9999}, "paid": {"type": "boolean"},
            "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
                "type": "object", "additionalProperties": False, "required": ["sku", "qty"],
                "properties": {"sku": {"enum": ["A1", "B2", "C3"]},
                               "qty": {"type": "integer", "minimum": 1, "maximum": 9}}}},
        },
    },
    "point": {
        "type": "object", "additionalProperties": False, "required": ["x", "y", "tags"],
        "properties": {"x": {"type": "number", "minimum": -10, "maximum": 10},
                       "y": {"type": "number", "minimum": -10, "maximum": 10},
                       "tags": {"type": "array", "maxItems": 2, "items": {"type": "string", "maxLength": 4}}},
    },
}


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLMEngine.from_model_dir(tiny_model_dir, device="cpu", dtype="float32", num_blocks=512)


def json_params(schema: dict, **kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 120, "temperature": 1.0, **kw},
                          structured_outputs=StructuredOutputs(json=json.dumps(schema)))


def run(engine, requests: dict) -> dict:
    """{request id: (prompt, params[, resume])} all at once -> {id: {choice: [ids, text, reason, error]}}."""
    for rid, (prompt, params, *resume) in requests.items():
        engine.add_request(rid, prompt, params, *resume)
    out: dict = {rid: {} for rid in requests}
    while engine.has_unfinished():
        for o in engine.step():
            got = out[o.request_id].setdefault(o.index, [[], "", None, None])
            got[0] += o.new_token_ids
            got[1] += o.text
            got[2], got[3] = o.finish_reason, o.error or got[3]
    return out


def test_json_schema_outputs_validate_across_seeds_and_schemas(engine):
    requests = {f"{name}-{seed}": (PROMPT, json_params(schema, seed=seed))
                for name, schema in SCHEMAS.items() for seed in range(6)}
    for rid, choices in run(engine, requests).items():
        ids, text, reason, error = choices[0]
        assert error is None and reason == "stop", (rid, text, reason)
        jsonschema.validate(json.loads(text), SCHEMAS[rid.split("-")[0]])


def test_json_object_regex_and_choice_hold(engine):
    regex = r"[0-9]{3}-[a-z]{2,4}"
    colours = ["red", "green", "light blue"]
    out = run(engine, {
        "obj": (PROMPT, SamplingParams(max_tokens=80, temperature=0.0,
                                       structured_outputs=StructuredOutputs(json_object=True))),
        "re": (PROMPT, SamplingParams(max_tokens=20, temperature=1.0, seed=3,
                                      structured_outputs=StructuredOutputs(regex=regex))),
        "choice": (PROMPT, SamplingParams(max_tokens=20, temperature=1.0, seed=4,
                                          structured_outputs=StructuredOutputs(choice=colours))),
        "ebnf": (PROMPT, SamplingParams(max_tokens=20, temperature=0.0, structured_outputs=StructuredOutputs(
            grammar='root ::= "yes" | "no" | "maybe " [0-9]'))),
    })
    obj = out["obj"][0]
    if obj[2] == "stop":  # any object may run long; when it ended, it is one
        assert isinstance(json.loads(obj[1]), dict)
    else:
        assert obj[1].startswith("{") and obj[2] == "length"
    assert re.fullmatch(regex, out["re"][0][1]) and out["re"][0][2] == "stop"
    assert out["choice"][0][1] in colours and out["choice"][0][2] == "stop"
    assert re.fullmatch(r"yes|no|maybe [0-9]", out["ebnf"][0][1])


def test_each_of_n_choices_has_its_own_matcher(engine):
    out = run(engine, {"n": (PROMPT, json_params(SCHEMAS["person"], seed=9, n=2))})["n"]
    assert set(out) == {0, 1}
    texts = [out[i][1] for i in (0, 1)]
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMAS["person"])
    assert texts[0] != texts[1]  # two draws, not one matcher shared


def test_max_tokens_inside_a_structure_ends_with_length(engine):
    ids, text, reason, _ = run(engine, {"cut": (PROMPT, json_params(SCHEMAS["order"], seed=1, max_tokens=5))})["cut"][0]
    assert reason == "length" and len(ids) == 5 and text.startswith("{")


def test_min_tokens_does_not_outlast_a_complete_structure(engine):
    """The grammar says where the output may end: a choice it completes before min_tokens ends with
    stop (banning EOS there would leave the row no token at all)."""
    params = SamplingParams(max_tokens=20, min_tokens=10, seed=3,
                            structured_outputs=StructuredOutputs(choice=["yes", "no"]))
    ids, text, reason, error = run(engine, {"short": (PROMPT, params)})["short"][0]
    assert error is None and reason == "stop" and text in {"yes", "no"}


def test_min_tokens_holds_stop_ids_back_from_a_constrained_choice(engine):
    """The grammar allows "a" or "b" and the bias pushes "a", a stop id: held back for min_tokens,
    then it stops the choice."""
    assert engine.tokenizer.decode([67]) == "a"
    params = SamplingParams(max_tokens=8, temperature=0.0, min_tokens=3, stop_token_ids=[67], logit_bias={67: 100.0},
                            structured_outputs=StructuredOutputs(regex="[ab]+"))
    ids, text, reason, error = run(engine, {"held": (PROMPT, params)})["held"][0]
    assert error is None and reason == "stop" and len(ids) == 4 and ids[3] == 67
    assert 67 not in ids[:3] and re.fullmatch("[ab]+", text)


def test_a_stop_id_the_grammar_requires_within_min_tokens_is_text(engine):
    """Holding "a" back would leave the row no token: the grammar's token is written, as text, and
    stops the choice only past min_tokens."""
    params = SamplingParams(max_tokens=8, temperature=0.0, min_tokens=3, stop_token_ids=[67],
                            structured_outputs=StructuredOutputs(regex="aaaa"))
    ids, text, reason, error = run(engine, {"forced": (PROMPT, params)})["forced"][0]
    assert (ids, text, reason, error) == ([67] * 4, "aaa", "stop", None)


def test_a_resumed_request_with_every_choice_finished_leaves_nothing_in_the_engine(engine):
    params = json_params(SCHEMAS["point"], seed=4, n=2)
    engine.add_request("all-done", PROMPT, params, Resume(output_ids={0: [], 1: []}, finished={0, 1}))
    assert "all-done" not in engine.requests and not engine.has_unfinished()


def test_seeded_constrained_request_is_the_same_alone_and_in_a_batch(engine):
    params = json_params(SCHEMAS["order"], seed=21)
    alone = run(engine, {"a": (PROMPT, params)})["a"][0][0]
    batch = run(engine, {"b": (PROMPT, params), "x": (PROMPT[:3], json_params(SCHEMAS["point"], seed=2)),
                         "y": ([9, 8, 7, 6], SamplingParams(max_tokens=30, temperature=1.0, seed=5))})
    assert batch["b"][0][0] == alone


def test_free_rows_tokens_are_identical_without_the_constrained_rows(engine):
    free = {f"f{i}": ([11 + i, 200, 300 + i], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
            for i in range(3)}
    alone = run(engine, free)
    constrained = {f"c{i}": (PROMPT, json_params(SCHEMAS["person"], seed=i, temperature=0.0 if i else 1.0))
                   for i in range(3)}
    mixed = run(engine, {**free, **constrained})
    for rid in free:
        assert mixed[rid][0][0] == alone[rid][0][0]
    for rid in constrained:
        jsonschema.validate(json.loads(mixed[rid][0][1]), SCHEMAS["person"])


def test_a_preempted_constrained_request_stays_valid(tiny_model_dir):
    small = LLMEngine.from_model_dir(tiny_model_dir, device="cpu", dtype="float32", num_blocks=12, block_size=4)
    prompts = [[20 + i] * 6 for i in range(4)]
    out = run(small, {f"p{i}": (p, json_params(SCHEMAS["order"], seed=i, max_tokens=36)) for i, p in enumerate(prompts)})
    assert small.stats()["num_preemptions"] > 0
    for rid, choices in out.items():
        ids, text, reason, error = choices[0]
        assert error is None
        if reason == "stop":
            jsonschema.validate(json.loads(text), SCHEMAS["order"])
    whole = run(LLMEngine.from_model_dir(tiny_model_dir, device="cpu", dtype="float32", num_blocks=512),
                {f"p{i}": (p, json_params(SCHEMAS["order"], seed=i, max_tokens=36)) for i, p in enumerate(prompts)})
    assert {r: c[0][0] for r, c in out.items()} == {r: c[0][0] for r, c in whole.items()}  # seeded: same draws


def test_resume_from_half_the_tokens_continues_exactly(engine):
    params = json_params(SCHEMAS["order"], seed=13, n=2)
    whole = run(engine, {"w": (PROMPT, params)})["w"]
    cut = {i: ids[:len(ids) // 2] for i, (ids, *_) in whole.items()}
    resumed = run(engine, {"r": (PROMPT, params, Resume(output_ids=cut))})["r"]
    for i, (ids, _, reason, error) in whole.items():
        assert error is None and resumed[i][3] is None
        assert cut[i] + resumed[i][0] == ids and resumed[i][2] == reason == "stop"


def test_resumed_tokens_the_grammar_refuses_end_that_request(engine):
    bad = Resume(output_ids={0: [5, 6, 7]})  # not how any JSON object starts
    out = run(engine, {"r": (PROMPT, json_params(SCHEMAS["person"], seed=1), bad)})["r"][0]
    assert out[2] == "error" and out[3].code == "resume_failed"


@pytest.mark.parametrize("spec, words", [
    (StructuredOutputs(json='{"type": "nonsense"}'), "json could not be compiled"),
    (StructuredOutputs(regex="(unclosed"), "regex could not be compiled"),
    (StructuredOutputs(grammar="root ::= missing_rule"), "grammar could not be compiled"),
])
def test_a_bad_spec_fails_its_request_alone(engine, spec, words):
    out = run(engine, {
        "bad": (PROMPT, SamplingParams(max_tokens=10, structured_outputs=spec)),
        "good": (PROMPT, json_params(SCHEMAS["person"], seed=3)),
        "free": (PROMPT, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)),
    })
    error = out["bad"][0][3]
    assert out["bad"][0][2] == "error" and error.code == "invalid_structured_output"
    assert words in error.message and error.param == "structured_outputs"
    assert "/project/" not in error.message  # xgrammar's log prefix is cut
    jsonschema.validate(json.loads(out["good"][0][1]), SCHEMAS["person"])
    assert len(out["free"][0][0]) == 5
    again = run(engine, {"again": (PROMPT, SamplingParams(max_tokens=10, structured_outputs=spec))})
    assert again["again"][0][3].code == "invalid_structured_output"  # remembered, refused again


@pytest.mark.parametrize("spec, words", [
    (StructuredOutputs(regex=r"[^\s\S]"), "regex can match nothing"),
    (StructuredOutputs(grammar="root ::= [^\\x00-\\U0010FFFF]"), "grammar can match nothing"),
    (StructuredOutputs(json=json.dumps({"type": "number", "minimum": 1e-7, "maximum": 2e-7})),
     "the empty string only: xgrammar cannot express it"),
])
def test_a_grammar_with_nothing_to_write_is_refused_before_any_token(engine, spec, words):
    """An empty language sent every logit to -inf (a 500 the gateway retried and counted against the
    version's breaker); a schema xgrammar turns into the empty string answered "" as if it held."""
    out = run(engine, {"none": (PROMPT, SamplingParams(max_tokens=10, structured_outputs=spec))})
    error = out["none"][0][3]
    assert out["none"][0][2] == "error" and error.code == "invalid_structured_output" and words in error.message
    assert out["none"][0][0] == []


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_grammar_that_dead_ends_fails_its_request_alone_as_a_400(engine, temperature):
    """Nothing past a prefix: the request ends where the grammar does, naming it; the rest of the
    batch is untouched."""
    spec = StructuredOutputs(regex=r"ab[^\s\S]")
    out = run(engine, {
        "dead": (PROMPT, SamplingParams(max_tokens=10, temperature=temperature, structured_outputs=spec, n=2)),
        "good": (PROMPT, json_params(SCHEMAS["person"], seed=3)),
        "free": (PROMPT, SamplingParams(max_tokens=5, temperature=temperature, ignore_eos=True)),
    })
    error = out["dead"][0][3]
    assert out["dead"][0][2] == "error" and error.code == "invalid_structured_output", error
    # "ab" in two tokens, or in one where the vocabulary holds it (either choice may be the first to end)
    assert re.search(r"leaves no token to write after [12] tokens", error.message), error.message
    assert out["dead"][0][1] in ("a", "ab") and error.param == "structured_outputs"
    jsonschema.validate(json.loads(out["good"][0][1]), SCHEMAS["person"])
    assert len(out["free"][0][0]) == 5 and out["free"][0][3] is None
    assert not engine.has_unfinished()


@pytest.mark.parametrize("spec, words", [
    (StructuredOutputs(json="{not json"), "not valid JSON"),
    (StructuredOutputs(choice=[]), "non-empty list"),
    (StructuredOutputs(regex="a", choice=["a"]), "exactly one"),
    (StructuredOutputs(json=json.dumps({"enum": ["x" * 70_000]})), "structured_max_spec_bytes"),
    (StructuredOutputs(json='{"items": ' * 65 + '{}' + '}' * 65), "deeper than 64 levels"),
])
def test_refused_at_add_request_without_a_trace(engine, spec, words):
    with pytest.raises(EngineRejected, match=words) as caught:
        engine.add_request("r", PROMPT, SamplingParams(structured_outputs=spec))
    assert caught.value.code == "invalid_structured_output" and caught.value.param == "structured_outputs"
    assert not engine.has_unfinished() and "r" not in engine.requests


def test_a_compile_past_its_time_bound_fails_its_request(tiny_model_dir):
    quick = LLMEngine.from_model_dir(tiny_model_dir, device="cpu", dtype="float32", num_blocks=64,
                                     structured_compile_timeout_s=1e-4)
    # ~0.9 s to compile: far longer than the ~30 ms xgrammar can hold the GIL in one go, which could
    # let a 40 ms compile finish before the first step looked at it
    out = run(quick, {"slow": (PROMPT, SamplingParams(max_tokens=120, structured_outputs=_ranges(300))),
                      "free": (PROMPT, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))})
    assert out["slow"][0][3].code == "invalid_structured_output"
    assert "structured_compile_timeout_s" in out["slow"][0][3].message
    assert len(out["free"][0][0]) == 4


def test_a_grammar_whose_matching_outgrows_its_bound_fails_its_request_alone(tiny_model_dir):
    """`s ::= s s | "a"` compiles at once, but matching it grows with the output (about the cube
    of its length a token: 20 ms at 400 tokens, a second at 1,150), on the step loop. Past
    structured_max_token_ms for one token its request ends with a 400 naming the bound; the request
    beside it runs to its end."""
    from worker.engine.tokenizer import load_tokenizer

    a = load_tokenizer(tiny_model_dir).convert_tokens_to_ids("a")
    bounded = LLMEngine.from_model_dir(tiny_model_dir, device="cpu", dtype="float32", num_blocks=256,
                                       structured_max_token_ms=1.0)
    ambiguous = SamplingParams(max_tokens=1500, temperature=0.0, logit_bias={a: 100.0},
                               structured_outputs=StructuredOutputs(grammar='root ::= s "."\ns ::= s s | "a"'))
    out = run(bounded, {"ambiguous": (PROMPT, ambiguous),
                        "free": (PROMPT, SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True))})
    ids, text, reason, error = out["ambiguous"][0]
    assert error is not None and error.code == "invalid_structured_output", (reason, len(ids))
    assert "structured_max_token_ms" in error.message and error.param == "structured_outputs"
    assert 20 < len(ids) < 1500 and set(text) == {"a"}  # it ran, and stopped long before max_tokens
    assert len(out["free"][0][0]) == 300 and out["free"][0][3] is None


def test_the_matching_bound_is_a_rate_not_a_total(tiny_model_dir):
    """The bound is a cost a token, not a request's total: a plain JSON schema's matching stays far
    under a tight one however long its output."""
    tight = LLMEngine.from_model_dir(tiny_model_dir, device="cpu", dtype="float32", num_blocks=256,
                                     structured_max_token_ms=5.0)
    schema = {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 40, "maxItems": 40}
    out = run(tight, {"long": (PROMPT, json_params(schema, max_tokens=600, temperature=0.0))})
    ids, text, reason, error = out["long"][0]
    assert error is None and reason == "stop" and len(ids) > 100
    assert len(json.loads(text)) == 40


def test_the_matching_meter_absorbs_one_slow_token_and_stops_a_sustained_cost():
    meter = MatchingMeter(max_token_ms=2.0)  # a window of 16 tokens: 32 ms in all
    meter.charge(25_000_000)  # a grammar's first pass through a rule: one dear token
    for _ in range(40):
        meter.pending_ns = 100_000  # the mask
        meter.charge(50_000)  # the accept
    with pytest.raises(EngineRejected, match="structured_max_token_ms") as caught:
        for n in range(MatchingMeter.WINDOW):
            meter.charge(2_500_000)  # over the rate on every token: caught within one window
    assert n < MatchingMeter.WINDOW - 1 and caught.value.code == "invalid_structured_output"


def _ranges(n: int, salt: int = 0) -> StructuredOutputs:
    """A schema of n integer ranges: its compiled grammar's token masks grow with n (~65 KB each
    with the tests' 2k vocabulary)."""
    props = {f"k{i}": {"type": "integer", "minimum": -10**15 + i + salt, "maximum": 10**15 - i} for i in range(n)}
    return StructuredOutputs(json=json.dumps({"type": "object", "properties": props, "required": list(props)}))


def test_the_grammar_cache_is_bounded_in_bytes(tiny_model_dir):
    """Distinct schemas whose grammars hold megabytes each (an attacker's, say) cannot fill the
    worker's memory: the least recently used go once structured_cache_mb is full."""
    small = LLMEngine.from_model_dir(tiny_model_dir, device="cpu", dtype="float32", num_blocks=64,
                                     structured_cache_mb=1.0)
    sizes = [small.grammars.submit(_ranges(6, salt)).result().memory_size_bytes for salt in range(12)]
    assert sum(sizes) > 2 * 2**20 and max(sizes) < 2**20  # twice the bound in all, each under it
    assert small.grammars.cached_bytes <= 2**20 and len(small.grammars._cache) < 12
    newest = small.grammars.submit(_ranges(6, 11))
    assert newest.done() and newest.result().memory_size_bytes == sizes[-1]  # the newest stays cached


def test_a_grammar_larger_than_the_cache_is_refused(tiny_model_dir):
    small = LLMEngine.from_model_dir(tiny_model_dir, device="cpu", dtype="float32", num_blocks=64,
                                     structured_cache_mb=1.0)
    out = run(small, {"big": (PROMPT, SamplingParams(max_tokens=8, structured_outputs=_ranges(40))),
                      "free": (PROMPT, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))})
    error = out["big"][0][3]
    assert error.code == "invalid_structured_output" and "structured_cache_mb" in error.message, error
    assert len(out["free"][0][0]) == 4 and small.grammars.cached_bytes == 0


def test_tenants_take_turns_at_the_compile_pool(tiny_model_dir):
    """A tenant's compiles run one at a time and tenants take turns: one sending slow schemas (a
    compile cannot be stopped, so each holds a thread to its end) does not make another's wait
    behind all of them. Before, the pool was first come first served, two at once."""
    grammars = LLMEngine.from_model_dir(tiny_model_dir, device="cpu", dtype="float32", num_blocks=64).grammars
    slow = [grammars.submit(_ranges(120, salt), tenant="flood") for salt in range(3)]
    quick = grammars.submit(StructuredOutputs(regex="[0-9]{3}"), tenant="light")
    order = []
    for future, name in [(quick, "light"), *((f, f"flood{i}") for i, f in enumerate(slow))]:
        future.add_done_callback(lambda _, name=name: order.append(name))
    for future in slow:
        future.result()
    assert order.index("light") < order.index("flood1"), order  # not behind the flood's queue


def test_the_tenantless_share_the_whole_pool(tiny_model_dir):
    grammars = LLMEngine.from_model_dir(tiny_model_dir, device="cpu", dtype="float32", num_blocks=64).grammars
    both = [grammars.submit(_ranges(120, 100 + salt)) for salt in range(2)]
    assert grammars._running.get(None) == 2  # neither waits for the other (an in-process engine)
    assert all(f.result().memory_size_bytes > 0 for f in both)


def test_a_queued_compile_its_requests_gave_up_on_is_dropped(tiny_model_dir):
    impatient = LLMEngine.from_model_dir(tiny_model_dir, device="cpu", dtype="float32", num_blocks=64,
                                         structured_compile_timeout_s=0.05)
    grammars, before = impatient.grammars, len(impatient.grammars.compile_seconds)
    first = grammars.submit(_ranges(120, 200), tenant="a")
    second = grammars.submit(_ranges(120, 201), tenant="a")  # waits for the first, past its deadline
    assert first.result().memory_size_bytes > 0
    with pytest.raises(EngineRejected, match="structured_compile_timeout_s"):
        second.result(timeout=30)
    assert len(grammars.compile_seconds) == before + 1  # the second never ran
    again = grammars.submit(_ranges(120, 201), tenant="a")  # asked again: not the dropped one's error
    assert again is not second and again.result().memory_size_bytes > 0


def test_the_compile_cache_compiles_each_spec_once(engine):
    before = len(engine.grammars.compile_seconds)
    spec = {"type": "object", "required": ["only"], "properties": {"only": {"enum": [1, 2]}}}
    run(engine, {f"c{i}": (PROMPT, json_params(spec, seed=i)) for i in range(3)})
    run(engine, {"c4": (PROMPT, json_params(spec, seed=4))})
    assert len(engine.grammars.compile_seconds) == before + 1


def test_the_paged_engine_only_takes_structured_outputs(tiny_model_dir):
    from worker.engine.hf_engine import HFEngine

    hf = HFEngine.from_model_dir(tiny_model_dir, device="cpu")
    with pytest.raises(EngineRejected, match="paged engine"):
        hf.add_request("r", PROMPT, json_params(SCHEMAS["person"]))


def test_no_constraint_while_thinking_and_the_matcher_starts_when_thinking_ends(engine):
    """The demo template thinks (Qwen-style): its <think> and </think> are single tokens."""
    start, end = engine.think_markers.start_id, engine.think_markers.end_id
    letter = engine.tokenizer.convert_tokens_to_ids("x")
    digits = StructuredOutputs(regex="[0-9]{2}")
    thinking = run(engine, {"t": (PROMPT + [start], SamplingParams(
        max_tokens=3, temperature=0.0, logit_bias={letter: 100.0}, structured_outputs=digits))})["t"][0]
    assert thinking[0] == [letter] * 3  # free while thinking: the bias wins over the grammar
    resumed = run(engine, {"r": (PROMPT + [start], SamplingParams(
        max_tokens=12, temperature=0.0, logit_bias={letter: 100.0}, structured_outputs=digits),
        Resume(output_ids={0: [letter, letter, end]}))})["r"][0]
    assert re.fullmatch("[0-9]{2}", resumed[1]) and resumed[2] == "stop"  # constrained once it ended
    answering = run(engine, {"a": (PROMPT + [start, letter, end], SamplingParams(
        max_tokens=12, temperature=0.0, logit_bias={letter: 100.0}, structured_outputs=digits))})["a"][0]
    assert re.fullmatch("[0-9]{2}", answering[1])  # thinking closed in the prompt: constrained at once


class _NoThinkTokenizer:
    chat_template = "{{ '<think>' }}"  # implies qwen3, but the vocabulary lacks the markers

    def encode(self, text, add_special_tokens=False):
        return list(text.encode())  # byte by byte: no marker is one token


def test_think_markers_come_from_the_template_and_the_vocabulary(engine):
    tok = engine.tokenizer
    assert think_markers(None, tok) == think_markers("qwen3", tok) == ThinkMarkers(
        tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("</think>"))
    assert think_markers(None, _NoThinkTokenizer()) is None  # implied, not tokens: gate off
    with pytest.raises(ValueError, match="not tokens"):
        think_markers("qwen3", _NoThinkTokenizer())  # configured, not tokens: refuse to start
    with pytest.raises(ValueError, match="unknown reasoning_parser"):
        think_markers("nope", tok)


def test_the_gate_follows_the_shared_thinking_rule(engine):
    grammar = engine.grammars.submit(StructuredOutputs(regex="[0-9]+")).result()
    markers = ThinkMarkers(1500, 1501)
    assert Constraint(grammar, [1, 2, 3], markers).active  # no marker: answering
    assert not Constraint(grammar, [1, 1500, 3], markers).active  # the template opened <think>
    assert Constraint(grammar, [1, 1500, 1501, 3], markers).active  # and closed it (thinking off)
    opened = Constraint(grammar, [1, 1501, 1500], markers)
    assert not opened.active and opened.accept(7) and opened.accept(1501) and opened.active


def test_abort_while_the_grammar_compiles(engine):
    spec = StructuredOutputs(json=json.dumps({"type": "object", "required": ["abort_me"],
                                              "properties": {"abort_me": {"type": "integer"}}}))
    engine.add_request("a", PROMPT, SamplingParams(n=2, structured_outputs=spec))
    assert engine.stats()["num_waiting"] == 2
    engine.abort("a")
    outs = engine.step()
    assert sorted((o.index, o.finish_reason) for o in outs) == [(0, "abort"), (1, "abort")]
    assert not engine.has_unfinished() and engine.pool.num_free_blocks == engine.pool.num_blocks


def test_a_resumed_request_whose_choices_all_ended_leaves_nothing_waiting(engine):
    engine.add_request("done", PROMPT, json_params(SCHEMAS["person"], n=2), Resume(finished={0, 1}))
    assert engine.step() == [] and not engine.has_unfinished()
