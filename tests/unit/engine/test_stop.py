"""Where generation ends: EOS and stop tokens, max_tokens, the context; generation_config's EOS."""

import json

from splitfuse.engine.sequence import FinishReason, SamplingParams, Sequence
from splitfuse.engine.stop import StopChecker, eos_token_ids, generation_eos_ids


def _seq(**params) -> Sequence:
    return Sequence("r", [1, 1, 1], SamplingParams(**params), arrival=0)


def _append(checker: StopChecker, seq: Sequence, token: int):
    seq.append_token(token)
    return checker.check(seq, token, None)


def test_eos_and_stop_tokens_stop_ignore_eos_keeps_only_the_stop_tokens():
    checker = StopChecker({2}, max_model_len=100)
    seq = _seq(max_tokens=10, stop_token_ids=[9])
    assert _append(checker, seq, 5) is None
    assert _append(checker, seq, 2) is FinishReason.STOP
    seq = _seq(max_tokens=10, stop_token_ids=[9], ignore_eos=True)
    assert _append(checker, seq, 2) is None
    assert _append(checker, seq, 9) is FinishReason.STOP


def test_max_tokens_and_context_end_with_length():
    checker = StopChecker({2}, max_model_len=5)
    seq = _seq(max_tokens=2)
    assert _append(checker, seq, 5) is None
    assert _append(checker, seq, 5) is FinishReason.LENGTH
    seq = _seq(max_tokens=10)
    assert [_append(checker, seq, 5) for _ in range(2)] == [None, FinishReason.LENGTH]  # 3 + 2 = max_model_len


def test_generation_config_eos_comes_first(tmp_path):
    assert generation_eos_ids(str(tmp_path)) == []
    assert eos_token_ids(str(tmp_path), [7], tokenizer_eos=None) == {7}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 4]}))
    assert generation_eos_ids(str(tmp_path)) == [3, 4]
    assert eos_token_ids(str(tmp_path), [7], tokenizer_eos=8) == {3, 4, 8}
