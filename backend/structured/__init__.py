"""Structured outputs: generation constrained to a JSON schema, any JSON, a regular expression,
an EBNF grammar or a choice among strings, with xgrammar as the grammar engine.

    guide.py     Guide: what a request asks for (kind and text), validated
    grammars.py  GrammarCache: compiling guides for one tokenizer (cached by text)
    compile_worker.py  CompileWorker: the child process that compiles them, bounded in time and
                 memory, so a guide that crashes or wedges the compiler fails its request only
    matcher.py   Matcher: one sequence's place in its grammar, masking each step's logits and
                 following the sampled tokens
"""
