"""Structured outputs: generation constrained to a JSON schema, any JSON, a regular expression,
an EBNF grammar or a choice among strings, with xgrammar as the grammar engine.

    guide.py     Guide: what a request asks for (kind and text), validated
    grammars.py  GrammarCache: compiling guides for one tokenizer (cached by text), and the
                 per-sequence matchers that mask each step's logits and follow the sampled tokens
"""
