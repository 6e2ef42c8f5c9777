"""Log-prob building stays linear and bounded (issue 55): each token's entries are built once,
when its step arrives, and appended, never copied again at a later step; the whole answer is
made of the streamed steps' own entries; a request that could build more entries than the
front's limit is refused up front, naming the limit."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="fastapi is in the serve extra")

from splitfuse.openai_api.choice_output import ChatChoiceOutput, CompletionChoiceOutput  # noqa: E402
from splitfuse.openai_api.config import ApiConfig  # noqa: E402
from splitfuse.openai_api.logprobs import check_budget, entries  # noqa: E402
from splitfuse.openai_api.protocol import ApiError  # noqa: E402
from splitfuse.openai_api.triton_llm import Step  # noqa: E402

TOP = 3


def strings(ids: list[int]) -> list[str]:
    return [f"t{i}" for i in ids]


def step(i: int, last: bool = False) -> Step:
    """Token i with TOP alternatives, streamed."""
    return Step(text=f"t{i}", token_ids=[i], logprobs=[-0.5], finish_reason="length" if last else None,
                num_input_tokens=3, num_output_tokens=i + 1, final=last,
                top_ids=[[i, 100 + i, 200 + i][:TOP]], top_logprobs=[[-0.5, -1.0, -2.0][:TOP]])


def test_chat_entries_are_built_once_and_appended_not_copied():
    out = ChatChoiceOutput(0, "none", logprobs=True, strings=strings)
    log = out.lp_log.content  # the one list every step appends to
    sent = []
    for i in range(50):
        chunk = out.step(step(i, last=i == 49))
        sent += chunk["logprobs"]["content"]
        # After each step the earlier entries are still the very objects first built: nothing
        # rebuilt or copied them (the old code re-made every list at every step).
        assert out.lp_log.content is log and len(log) == i + 1
        assert all(a is b for a, b in zip(log, sent))
    whole = out.whole()["logprobs"]["content"]
    assert whole is log and [e["token"] for e in whole] == [f"t{i}" for i in range(50)]
    assert all(len(e["top_logprobs"]) == TOP for e in whole)


def test_completion_entries_are_built_once_and_appended_not_copied():
    out = CompletionChoiceOutput(0, logprobs=TOP, echo="p: ", strings=strings)
    lists = (out.lp_log.tokens, out.lp_log.token_logprobs, out.lp_log.top_logprobs, out.lp_log.text_offset)
    rows = []
    for i in range(50):
        chunk = out.step(step(i, last=i == 49))
        rows += chunk["logprobs"]["top_logprobs"]
        assert all(len(lst) == i + 1 for lst in lists)
        assert all(a is b for a, b in zip(out.lp_log.top_logprobs, rows))
    whole = out.whole()["logprobs"]
    assert (whole["tokens"], whole["token_logprobs"], whole["top_logprobs"], whole["text_offset"]) == lists
    assert whole["top_logprobs"] is lists[2]
    # Offsets count characters of the whole text, after the echoed prompt.
    assert whole["text_offset"][:3] == [3, 5, 7] and out.whole()["text"].startswith("p: t0t1t2")


def test_a_request_over_the_entry_budget_is_refused_naming_the_limit():
    assert entries(n=16, max_tokens=1000, top_logprobs=20) == 336_000
    check_budget(16, 1000, 20, limit=336_000, param="top_logprobs")  # exactly at the limit: taken
    with pytest.raises(ApiError) as e:
        check_budget(16, 1000, 20, limit=335_999, param="top_logprobs")
    err = e.value
    assert err.status == 400 and err.param == "top_logprobs" and err.code == "logprobs_limit_exceeded"
    assert "335999" in err.message and "--max-logprob-entries" in err.message and "336000" in err.message
    assert ApiConfig.max_logprob_entries == 200_000  # the documented default
    with pytest.raises(ValueError, match="max_logprob_entries"):
        ApiConfig(model_dir=".", max_logprob_entries=0)
