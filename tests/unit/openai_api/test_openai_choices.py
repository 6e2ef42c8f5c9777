"""The OpenAI front's choices without a server: each choice's answer from its `llm` responses
(streamed deltas add up to the whole answer; tool calls; log-probs), running n generations
(choice 0 first, the others once it answered; one failure or closing ends them all), and the
top log-prob outputs read from a Triton response."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="fastapi is in the serve extra")

from splitfuse.openai_api.app import Job  # noqa: E402
from splitfuse.openai_api.choice_output import ChatChoiceOutput, CompletionChoiceOutput  # noqa: E402
from splitfuse.openai_api.choices import run_choices  # noqa: E402
from splitfuse.openai_api.logprobs import TokenLogprobs, chat_logprobs, completion_logprobs  # noqa: E402
from splitfuse.openai_api.responses import Meta  # noqa: E402
from splitfuse.openai_api.triton_llm import GenerationError, Step, parse_step  # noqa: E402

STRINGS = {i: s for i, s in enumerate(["<tool_call>", '{"name": "f", ', '"arguments": {"a": 1}}', "</tool_call>",
                                       "hi", " there", "x", "y"])}


def strings(ids: list[int]) -> list[str]:
    return [STRINGS[i] for i in ids]


def _steps(ids: list[int], reason: str = "stop", top: bool = False) -> list[Step]:
    """One streamed response per token, the last with the finish reason."""
    out = []
    for n, i in enumerate(ids, 1):
        last = n == len(ids)
        out.append(Step(text=STRINGS[i], token_ids=[i], logprobs=[-0.5], finish_reason=reason if last else None,
                        num_input_tokens=3, num_output_tokens=n, final=last,
                        top_ids=[[i, 7]] if top else None, top_logprobs=[[-0.5, -1.5]] if top else None))
    return out


def _whole(steps: list[Step]) -> Step:
    """The same generation as one non-streamed response."""
    return Step(text="".join(s.text for s in steps), token_ids=[i for s in steps for i in s.token_ids],
                logprobs=[lp for s in steps for lp in s.logprobs or []], finish_reason=steps[-1].finish_reason,
                num_input_tokens=3, num_output_tokens=len(steps), final=True,
                top_ids=[r for s in steps for r in s.top_ids or []] or None,
                top_logprobs=[r for s in steps for r in s.top_logprobs or []] or None)


def _accumulate(deltas: list[dict]) -> tuple[str | None, list[dict]]:
    content = None
    calls: list[dict] = []
    for d in deltas:
        if "content" in d["delta"]:
            content = (content or "") + d["delta"]["content"]
        calls += d["delta"].get("tool_calls", [])
    return content, calls


@pytest.mark.parametrize("mode", ["auto", "forced"])
def test_a_tool_call_streamed_adds_up_to_the_whole_answer(mode):
    ids = [4, 0, 1, 2, 3] if mode == "auto" else [1, 2]
    streamed = ChatChoiceOutput(0, mode, logprobs=True, strings=strings)
    deltas = [d for d in (streamed.step(s) for s in _steps(ids)) if d is not None]
    whole = ChatChoiceOutput(0, mode, logprobs=True, strings=strings)
    whole.step(_whole(_steps(ids)))
    answer = whole.whole()
    message = answer["message"]
    assert answer["finish_reason"] == deltas[-1]["finish_reason"] == streamed.whole()["finish_reason"] == "tool_calls"
    (call,) = message["tool_calls"]
    assert call["function"] == {"name": "f", "arguments": '{"a": 1}'} and call["id"].startswith("call_")
    assert message["content"] == ("hi" if mode == "auto" else None)
    content, calls = _accumulate(deltas)
    assert content == message["content"]
    assert [(c["index"], c["function"]) for c in calls] == [(0, call["function"])]
    assert sum(len(d["logprobs"]["content"]) for d in deltas if d["logprobs"]) == len(ids)
    assert len(answer["logprobs"]["content"]) == len(ids)


def test_a_forced_call_cut_short_is_content_and_plain_text_is_untouched():
    cut = ChatChoiceOutput(0, "forced", logprobs=False, strings=strings)
    for s in _steps([1], reason="length"):
        cut.step(s)
    assert cut.whole()["message"] == {"role": "assistant", "content": STRINGS[1]}
    assert cut.whole()["finish_reason"] == "length"
    plain = ChatChoiceOutput(2, "none", logprobs=False, strings=strings)
    assert plain.first() == {"index": 2, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}
    deltas = [plain.step(s) for s in _steps([4, 5, 0])]
    assert [d["delta"].get("content") for d in deltas] == ["hi", " there", "<tool_call>"]
    assert plain.whole()["message"] == {"role": "assistant", "content": "hi there<tool_call>"}
    assert plain.whole()["finish_reason"] == "stop" and plain.tokens.num_output == 3


def test_completion_choices_with_echo_and_top_logprobs():
    streamed = CompletionChoiceOutput(1, logprobs=2, echo="p: ", strings=strings)
    assert streamed.first()["text"] == "p: "
    deltas = [streamed.step(s) for s in _steps([4, 5], reason="length", top=True)]
    whole = CompletionChoiceOutput(1, logprobs=2, echo="p: ", strings=strings)
    whole.step(_whole(_steps([4, 5], reason="length", top=True)))
    answer = whole.whole()
    assert answer["text"] == "p: hi there" and answer["finish_reason"] == "length" and answer["index"] == 1
    lp = answer["logprobs"]
    assert lp["tokens"] == ["hi", " there"] and lp["text_offset"] == [3, 5]
    assert lp["top_logprobs"] == [{"hi": -0.5, "y": -1.5}, {" there": -0.5, "y": -1.5}]
    assert [d["logprobs"]["text_offset"] for d in deltas] == [[3], [5]]
    assert [d["logprobs"]["top_logprobs"] for d in deltas] == [[t] for t in lp["top_logprobs"]]


def test_logprob_objects_order_alternatives_and_keep_the_sampled_token():
    lp = TokenLogprobs([4], [-2.0], top_ids=[[6, 7, 5]], top_logprobs=[[-1.0, -0.1, -3.0]])
    chat = chat_logprobs(lp, strings)["content"][0]
    assert [t["token"] for t in chat["top_logprobs"]] == ["y", "x", " there"]
    assert chat["token"] == "hi" and chat["logprob"] == -2.0
    legacy = completion_logprobs(lp, strings, 0, want_top=True)["top_logprobs"][0]
    assert list(legacy) == ["y", "x", " there", "hi"]  # most likely first, then the sampled token
    assert completion_logprobs(lp, strings, 0, want_top=False)["top_logprobs"] is None
    # Tokens a grammar or top_k ruled out have -inf, which JSON cannot carry.
    masked = TokenLogprobs([4], [float("-inf")], top_ids=[[4, 6]], top_logprobs=[[-0.5, float("-inf")]])
    assert [t["logprob"] for t in chat_logprobs(masked, strings)["content"][0]["top_logprobs"]] == [-0.5, -9999.0]
    legacy = completion_logprobs(masked, strings, 0, want_top=True)
    assert legacy["token_logprobs"] == [-9999.0] and legacy["top_logprobs"] == [{"hi": -0.5, "x": -9999.0}]
    assert chat_logprobs(masked, strings)["content"][0]["logprob"] == -9999.0


def test_choice_inputs_give_each_choice_its_seed_and_stream_choice_0():
    job = Job(chat=True, meta=Meta("id", "m"), prompt_ids=[1, 2], inputs={"seed": 2**64 - 1, "max_tokens": 4},
              stream=False, include_usage=False, n=3, new_output=lambda i: None)
    assert [job.choice_inputs(i)["seed"] for i in range(3)] == [2**64 - 1, 0, 1]
    assert [job.choice_inputs(i)["stream"] for i in range(3)] == [True, False, False]
    assert replace(job, n=1).choice_inputs(0)["stream"] is False
    assert job.choice_inputs(0)["input_ids"] == [1, 2] and job.choice_inputs(0)["input_lengths"] == 2


# ---- running the choices --------------------------------------------------------------------


class FakeLLM:
    """Generations of a few steps each; records when each started and whether it was closed early."""

    def __init__(self, steps: int = 3, fail: int | None = None) -> None:
        self.steps = steps
        self.fail = fail
        self.started: list[tuple[int, int]] = []  # (choice, responses of choice 0 seen by then)
        self.closed: set[int] = set()
        self.sent0 = 0

    async def generate(self, i: int):
        self.started.append((i, self.sent0))
        done = False
        try:
            for n in range(self.steps):
                await asyncio.sleep(0.01)
                if i == self.fail:
                    raise GenerationError("boom")
                if i == 0:
                    self.sent0 += 1
                final = n == self.steps - 1
                done = final
                yield _steps([4])[0] if not final else _steps([4])[-1]
        finally:
            if not done:
                self.closed.add(i)


def _run(llm: FakeLLM, n: int, take: int | None = None) -> list[int]:
    async def main() -> list[int]:
        seen = []
        async with contextlib.aclosing(run_choices(llm.generate, n)) as items:
            async for i, _ in items:
                seen.append(i)
                if take is not None and len(seen) == take:
                    break
        return seen

    return asyncio.run(main())


def test_choices_start_once_choice_0_answered_and_all_finish():
    llm = FakeLLM()
    seen = _run(llm, 4)
    assert sorted(seen) == sorted([0, 1, 2, 3] * 3) and seen[0] == 0
    assert llm.started[0] == (0, 0) and all(before >= 1 for i, before in llm.started[1:])
    assert sorted(i for i, _ in llm.started) == [0, 1, 2, 3] and not llm.closed


def test_one_failing_choice_or_a_closed_stream_ends_every_generation():
    llm = FakeLLM(steps=50, fail=2)
    with pytest.raises(GenerationError, match="boom"):
        _run(llm, 3)
    assert llm.closed == {0, 1, 2}
    llm = FakeLLM(steps=50)
    _run(llm, 3, take=5)
    assert llm.closed == {0, 1, 2}


# ---- Triton responses -----------------------------------------------------------------------


class _Result:
    def __init__(self, arrays: dict[str, np.ndarray]) -> None:
        self.arrays = arrays

    def as_numpy(self, name: str):
        return self.arrays.get(name)

    def get_response(self):
        class R:
            parameters: dict = {}
        return R()


def test_top_log_prob_outputs_become_rows_per_token():
    step = parse_step(_Result({
        "text_output": np.array([[b"ab"]], dtype=object), "output_ids": np.array([[5, 6]], np.int32),
        "finish_reason": np.array([[b"length"]], dtype=object),
        "top_log_probs": np.array([[[-0.1, -2.0, -3.0], [-0.2, -1.0, -4.0]]], np.float32),
        "top_log_prob_ids": np.array([[[5, 1, 2], [6, 3, 4]]], np.int32)}))
    assert step.top_ids == [[5, 1, 2], [6, 3, 4]] and step.final and step.finish_reason == "length"
    assert np.allclose(step.top_logprobs, [[-0.1, -2.0, -3.0], [-0.2, -1.0, -4.0]])
    plain = parse_step(_Result({"output_ids": np.array([[5]], np.int32)}))
    assert plain.top_ids is None and plain.top_logprobs is None and not plain.final
