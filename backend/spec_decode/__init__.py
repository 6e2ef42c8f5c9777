"""Speculative decoding: proposers (`ngram`: prompt lookup; `draft`: a smaller model) and the
verification of their proposals in the target's step (`decoder`)."""
