"""The grammar cache's bounds: compiled grammars kept within a byte budget (least recently used
evicted), failed guides remembered by their normalized text, so an edit of key order or
whitespace is refused without compiling again."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from splitfuse.config import GrammarLimits
from splitfuse.structured.grammars import GrammarCache
from splitfuse.structured.guide import Guide

pytest.importorskip("xgrammar")


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return AutoTokenizer.from_pretrained(tiny_llama)


def test_the_compiled_cache_stays_within_its_byte_budget_evicting_the_least_recently_used(tokenizer):
    guides = [Guide("regex", f"[a-z]{{{n}}}-[0-9]") for n in range(3, 9)]
    probe = GrammarCache(tokenizer, len(tokenizer))
    try:
        sizes = [probe.compile(g).memory_size_bytes for g in guides]
    finally:
        probe.close()
    budget = sizes[0] + sizes[1] + sizes[2]  # room for about three
    cache = GrammarCache(tokenizer, len(tokenizer), GrammarLimits(cache_bytes=budget))
    try:
        cache.compile(guides[0])
        for g in guides[1:]:
            cache.compile(guides[0])  # kept in use: never the least recently used
            cache.compile(g)
            assert cache.cached_bytes <= budget
        assert 2 <= cache.num_cached < len(guides)
        compiles = cache.num_compiles
        cache.compile(guides[0])
        assert cache.num_compiles == compiles  # still cached
        cache.compile(guides[1])
        assert cache.num_compiles == compiles + 1  # evicted: compiled again
        assert cache.cached_bytes <= budget
    finally:
        cache.close()


def test_a_grammar_larger_than_the_whole_budget_is_used_but_not_kept(tokenizer):
    cache = GrammarCache(tokenizer, len(tokenizer), GrammarLimits(cache_bytes=1))
    try:
        assert cache.compile(Guide("regex", "[a-z]+")) is not None
        assert cache.num_cached == 0 and cache.cached_bytes == 0
    finally:
        cache.close()


FAILING_SCHEMA = {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}, "b": {"type": "integer"}}}


@pytest.mark.parametrize("first, edited", [
    (Guide("json_schema", json.dumps(FAILING_SCHEMA)),
     Guide("json_schema", json.dumps(FAILING_SCHEMA, indent=3, sort_keys=True))),
    (Guide("regex", "(ab[0-9]+  x"), Guide("regex", "(ab[0-9]+ \n x ")),
], ids=["json-schema-reordered-reindented", "regex-whitespace"])
def test_a_trivially_edited_failing_guide_is_refused_without_compiling(tokenizer, first, edited):
    assert first.text != edited.text
    cache = GrammarCache(tokenizer, len(tokenizer))
    try:
        with pytest.raises(ValueError) as error:
            cache.compile(first)
        compiles = cache.num_compiles
        with pytest.raises(ValueError) as again:
            cache.compile(edited)
        assert str(again.value) == str(error.value)
        assert cache.num_compiles == compiles  # the compiler was not asked again
    finally:
        cache.close()


def test_normalization_leaves_different_grammars_apart():
    a = Guide("json_schema", json.dumps({"type": "string", "enum": ["x", "y"]}))
    b = Guide("json_schema", json.dumps({"type": "string", "enum": ["x", "y", "z"]}))
    assert a.normalized() != b.normalized()
    assert Guide("regex", "a b").normalized() != Guide("regex", "ab").normalized()
