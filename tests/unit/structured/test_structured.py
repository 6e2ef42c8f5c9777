"""Structured outputs in the engine (splitfuse.structured, xgrammar): whatever the weights, every
output under a guide is one the guide allows. Random-weight models sample freely (temperature 1,
several seeds), so only the grammar can make their outputs valid."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from splitfuse import LLM, SamplingParams
from splitfuse.structured.guide import Guide

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
                                      "ok": {"type": "boolean"}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"inner": {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]$"}}, "required": ["code"], "additionalProperties": False},
        "level": {"enum": [1, 2, 3]}}, "required": ["inner", "level"], "additionalProperties": False},
]
SEEDS = range(4)


def _sampled(llm: LLM, guide: Guide, max_tokens: int = 160, **kw) -> list:
    params = [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, guide=guide, ignore_eos=True, **kw)
              for seed in SEEDS]
    return llm.generate(["the answer is"] * len(params), params)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    with LLM(tiny_llama, token_budget=64, block_size=4, attention_backend="torch") as engine:
        yield engine


@pytest.mark.parametrize("schema", SCHEMAS, ids=["scalars", "array-enum", "nested-pattern"])
def test_every_output_under_a_json_schema_validates(llm, schema):
    for out in _sampled(llm, Guide("json_schema", json.dumps(schema))):
        assert out.finish_reason == "stop", (out.finish_reason, out.text)  # the grammar ended it
        jsonschema.validate(json.loads(out.text), schema)


def test_any_json_regex_ebnf_and_choice(llm):
    for out in _sampled(llm, Guide("json"), max_tokens=400):
        if out.finish_reason == "stop":  # any JSON may be long: a finished one parses
            json.loads(out.text)
    for out in _sampled(llm, Guide("regex", "[a-z]{3}-[0-9]{2}")):
        assert re.fullmatch("[a-z]{3}-[0-9]{2}", out.text), out.text
    for out in _sampled(llm, Guide("ebnf_grammar", 'root ::= "yes" | "no" | "maybe " [0-9]')):
        assert re.fullmatch("yes|no|maybe [0-9]", out.text), out.text
    options = ["red", "green", "blue sky", 'say "hi"']
    for out in _sampled(llm, Guide("choice", json.dumps(options))):
        assert out.text in options, out.text


@pytest.mark.slow
def test_greedy_under_a_grammar_that_allows_the_answer_equals_unconstrained(trained_model):
    """A grammar that allows what the model says anyway leaves greedy decoding alone: the trained
    model (random weights emit byte tokens that form no UTF-8, which no character grammar matches)
    answers the same tokens free, under any-text and under a JSON-ish choice of its own answer."""
    prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    with LLM(trained_model, dtype="float32", token_budget=128) as engine:
        free = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0))[0]
        assert free.text.startswith("The capital of France is")
        for guide in (Guide("regex", r"[\s\S]*"), Guide("choice", json.dumps([free.text, "Lyon"]))):
            guided = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, guide=guide))[0]
            assert guided.token_ids[:len(free.token_ids)] == free.token_ids, guide.kind


def test_with_prefix_caching_preemption_and_speculation(tiny_llama):
    schema = SCHEMAS[0]
    # A pool of 24 blocks of 4 tokens: eight sequences at once preempt each other.
    with LLM(tiny_llama, token_budget=32, block_size=4, num_kv_blocks=24, kv_watermark=0.0, attention_backend="torch",
             speculative_method="ngram", enable_prefix_caching=True) as engine:
        params = [SamplingParams(max_tokens=60, temperature=1.0, seed=s, ignore_eos=True,
                                 guide=Guide("json_schema", json.dumps(schema))) for s in range(8)]
        outs = engine.generate(["the answer is the answer is"] * 8, params)
        assert engine.engine.scheduler.num_preemptions > 0
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculation_checks_drafts_against_the_grammar(tiny_llama, method):
    """Constrained sequences speculate: each proposed token is checked against the grammar (the
    row after it masked in the grammar's state past it) and the matcher follows only what
    verification accepts. Greedy tokens equal the run without speculation, for schemas, a regex
    and choices, while proposals were made and some accepted (the draft model is the target
    itself, so it proposes the target's unconstrained choices; the grammar refuses some)."""
    guides = [Guide("json_schema", json.dumps(s)) for s in SCHEMAS] + [
        Guide("regex", r"(ab|the|answer| |is)+\."), Guide("choice", json.dumps(["the answer is yes", "no"]))]
    prompt = "the answer is the answer is the answer is"
    params = [SamplingParams(max_tokens=48, temperature=0.0, guide=g) for g in guides]
    common = dict(token_budget=64, block_size=4, attention_backend="torch")
    with LLM(tiny_llama, **common) as plain:
        expected = [o.token_ids for o in plain.generate([prompt] * len(params), params)]
    spec = dict(speculative_method=method, num_speculative_tokens=4)
    if method == "draft":
        spec["speculative_model"] = tiny_llama
    with LLM(tiny_llama, **common, **spec) as engine:
        got = [o.token_ids for o in engine.generate([prompt] * len(params), params)]
        decoder = engine.engine.speculation
        assert decoder.num_proposed > 0 and decoder.num_accepted > 0, (decoder.num_proposed, decoder.num_accepted)
        engine.engine.check_invariants()
    assert got == expected


def test_allowed_prefix_counts_what_the_grammar_takes_and_leaves_the_matcher_alone(llm):
    tokenizer = llm.engine.tokenizer
    answer = tokenizer.encode("the answer is yes", add_special_tokens=False)
    matcher = llm.engine.grammars().matcher(Guide("choice", json.dumps(["the answer is yes", "no"])))
    assert matcher.allowed_prefix(answer + answer[:1]) == len(answer)  # complete: only the end may follow
    assert matcher.allowed_prefix(answer[1:]) == 0
    assert matcher.allowed_prefix(answer[:2]) == 2  # unchanged by the calls before
    for token in answer:
        matcher.accept(token)
    assert matcher.allowed_prefix(answer[:1]) == 0


@pytest.mark.parametrize("guide,words", [
    (("json_schema", "{not json"), "JSON"),
    (("json_schema", '{"type": "object", "properties": {"a": {"type": "nosuchtype"}}}'), "does not compile"),
    (("regex", "([a-z"), "does not compile"),
    (("ebnf_grammar", "root ::= ???"), "does not compile"),
    (("choice", "[]"), "choice"),
    (("choice", "not a list"), "choice"),
    (("xml", "<a/>"), "guided_decoding_guide_type"),
    (("regex", ""), "required"),
])
def test_bad_guides_are_refused_before_anything_runs(llm, guide, words):
    with pytest.raises(ValueError, match=words):
        llm.generate(["hi"], SamplingParams(max_tokens=4, guide=Guide(*guide)))
    out = llm.generate(["hi"], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[0]  # nothing disturbed
    assert len(out.token_ids) == 3


@pytest.mark.parametrize("schema,keyword,where", [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems", "/"),
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "not", "/properties/a"),
    ({"anyOf": [{"type": "integer"}, {"allOf": [{"type": "object"}]}]}, "allOf", "/anyOf/1"),
    ({"$defs": {"d": {"oneOf": [{"type": "integer"}, {"type": "number"}]}}, "$ref": "#/$defs/d"}, "oneOf",
     "/$defs/d"),
    ({"type": "array", "items": {"type": "array", "contains": {"const": 1}}}, "contains", "/items"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "dependentRequired": {"a": ["b"]}},
     "dependentRequired", "/"),
])
def test_schema_keywords_the_grammar_cannot_enforce_are_refused(llm, schema, keyword, where):
    """Sampled freely, outputs broke these keywords (schema_keywords.py): a request asking for
    one is refused naming it and where it is, rather than answered with output its schema rejects."""
    with pytest.raises(ValueError, match=f"keyword '{re.escape(keyword)}' at {re.escape(where)} is not supported"):
        llm.generate(["x"], SamplingParams(max_tokens=4, guide=Guide("json_schema", json.dumps(schema))))
    assert not llm.engine.has_unfinished_requests()


def test_a_guide_that_failed_is_refused_again_without_compiling(llm):
    grammars = llm.engine.grammars()
    bad = Guide("regex", "(unclosed[")
    with pytest.raises(ValueError, match="does not compile") as first:
        llm.generate(["x"], SamplingParams(max_tokens=4, guide=bad))
    compiles = grammars.num_compiles
    with pytest.raises(ValueError) as again:
        llm.generate(["x"], SamplingParams(max_tokens=4, guide=bad))
    assert str(again.value) == str(first.value) and grammars.num_compiles == compiles
    llm.generate(["x"], SamplingParams(max_tokens=4, guide=Guide("regex", "(closed)")))
    assert grammars.num_compiles == compiles + 1


def test_min_tokens_with_a_guide_is_refused():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=8, min_tokens=2, guide=Guide("json"))


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("candidates", [1, 64], ids=["whole-mask", "candidates"])
def test_rows_checked_after_sampling_equal_rows_masked_before(llm, temperature, candidates, monkeypatch):
    """Rows without log-probs or top-k/top-p are sampled first; a refused token is replaced by
    the best-scored allowed one (among the first `candidates`, else under the whole mask). Rows
    asking for log-probs are masked before sampling. Both must pick the very same tokens."""
    import splitfuse.structured.masking

    monkeypatch.setattr(splitfuse.structured.masking, "REPICK_CANDIDATES", candidates)
    guide = Guide("json_schema", json.dumps(SCHEMAS[0]))
    for seed in SEEDS:
        checked, masked = (llm.generate(["the answer is"], SamplingParams(
            max_tokens=60, temperature=temperature, seed=seed, guide=guide, logprobs=logprobs))[0]
            for logprobs in (False, True))
        assert checked.token_ids == masked.token_ids, seed
        jsonschema.validate(json.loads(checked.text), SCHEMAS[0])
        assert all(lp > float("-inf") for lp in masked.logprobs)


def test_masks_before_sampling_where_the_mask_changes_what_the_sampler_computes():
    from splitfuse.structured.masking import masks_before_sampling
    assert not masks_before_sampling(SamplingParams(temperature=0.0), 0)
    assert not masks_before_sampling(SamplingParams(temperature=0.7, repetition_penalty=1.2), 0)
    assert not masks_before_sampling(SamplingParams(temperature=0.0, top_k=5, top_p=0.5), 0)  # greedy ignores both
    for params, drafts in ((SamplingParams(temperature=0.7, top_k=5), 0), (SamplingParams(temperature=0.7, top_p=0.9), 0),
                           (SamplingParams(logprobs=True), 0), (SamplingParams(top_logprobs=2), 0),
                           (SamplingParams(), 3)):
        assert masks_before_sampling(params, drafts), (params, drafts)


def test_allows_checks_one_token_and_leaves_the_matcher_alone(llm):
    grammars = llm.engine.grammars()
    matcher = grammars.matcher(Guide("regex", "ab"))
    a, b = (llm.tokenizer.convert_tokens_to_ids(t) for t in "ab")
    assert matcher.allows(a) and not matcher.allows(b)
    assert matcher.first_allowed([b, grammars.vocab_size, a]) == a and matcher.first_allowed([b]) is None
    assert not matcher.allows(grammars.vocab_size) and not matcher.allows(-1)  # padded columns
    matcher.accept(a)  # still at the start: `allows` took nothing
    assert matcher.allows(b) and not matcher.allows(a)
    newline = llm.tokenizer.convert_tokens_to_ids("Ċ")
    json_matcher = grammars.matcher(Guide("json_schema", json.dumps({"type": "string"})))
    json_matcher.accept(llm.tokenizer.convert_tokens_to_ids('"'))
    assert not json_matcher.allows(newline)  # the control-character ban, inside a string


def test_structured_does_not_import_the_engine_at_runtime():
    """The engine builds on splitfuse.structured, not the reverse: engine types appear there
    under `if TYPE_CHECKING:` only (for annotations)."""
    import ast
    from pathlib import Path

    import splitfuse.structured

    for path in Path(splitfuse.structured.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text())
        checking = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                    and ast.unparse(node.test) == "TYPE_CHECKING" for n in ast.walk(node)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and id(node) not in checking:
                assert not (node.module or "").startswith("splitfuse.engine"), f"{path.name}: {ast.unparse(node)}"
            if isinstance(node, ast.Import) and id(node) not in checking:
                assert not any(a.name.startswith("splitfuse.engine") for a in node.names), path.name
