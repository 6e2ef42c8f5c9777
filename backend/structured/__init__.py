"""Structured outputs: generation constrained to a JSON schema, any JSON, a regular expression,
an EBNF grammar or a choice among strings, with xgrammar as the grammar engine.

    guide.py     Guide: what a request asks for (kind and text), validated
    grammars.py  GrammarCache: compiling guides for one tokenizer (cached by text)
    matcher.py   Matcher: one sequence's place in its grammar, masking each step's logits and
                 following the sampled tokens
"""
