"""ChoiceState: the text a client is sent from the engine's cumulative outputs (stop
strings, held-back tails, logprobs layout), without a model."""

from __future__ import annotations

from mlafx.runtime import CompletionOutput, RequestOutput
from mlafx.serve.choice import ChoiceState, completion_logprobs


def output(text: str, num_tokens: int, finish: str | None = None, logprobs=None):
    completion = CompletionOutput(
        index=0,
        token_ids=list(range(num_tokens)),
        text=text,
        finish_reason=finish,
        logprobs=logprobs,
    )
    return RequestOutput("0", [7, 8], [completion], finished=finish is not None)


def feed(state: ChoiceState, texts: list[str], finish_last: str | None = "length") -> list[str]:
    sent = []
    for i, text in enumerate(texts):
        last = i == len(texts) - 1
        delta = state.update(output(text, i + 1, finish_last if last else None))
        sent.append(delta.text)
        if state.finished:
            break
    return sent


def test_without_stop_strings_text_goes_out_as_it_grows():
    state = ChoiceState([], None, want_logprobs=False)
    assert feed(state, ["a", "ab", "abc"]) == ["a", "b", "c"]
    assert state.finish_reason == "length" and state.num_tokens == 3


def test_a_possible_stop_prefix_is_held_back_then_released():
    state = ChoiceState(["STOP"], None, want_logprobs=False)
    # "ST" might start "STOP": held; "STa" cannot: released
    assert feed(state, ["x S", "x ST", "x STa", "x STab"]) == ["x ", "", "STa", "b"]
    assert state.sent_text == "x STab"


def test_a_stop_string_split_across_tokens_ends_the_text_before_it():
    state = ChoiceState(["STOP", "never"], None, want_logprobs=False)
    sent = feed(state, ["hello S", "hello STO", "hello STOP and more"], finish_last=None)
    assert "".join(sent) == "hello " and state.finish_reason == "stop"


def test_the_earliest_of_several_stop_strings_wins():
    state = ChoiceState(["cd", "b"], None, want_logprobs=False)
    assert feed(state, ["abcd"], finish_last=None) == ["a"]
    assert state.finish_reason == "stop"


def test_an_incomplete_character_waits_for_its_next_token():
    state = ChoiceState([], None, want_logprobs=False)
    assert feed(state, ["a\ufffd", "a\u00e9", "a\u00e9\ufffd"]) == ["a", "\u00e9", "\ufffd"]


def test_a_finished_choice_sends_its_held_tail():
    state = ChoiceState(["STOP"], None, want_logprobs=False)
    assert feed(state, ["xS", "xST"], finish_last="length") == ["x", "ST"]


def test_logprobs_without_a_tokenizer_name_token_ids():
    state = ChoiceState([], None, want_logprobs=True)
    first = state.update(output("", 1, logprobs=[{0: -0.5, 9: -1.0}]))
    second = state.update(output("", 2, "length", logprobs=[{0: -0.5, 9: -1.0}, {1: -0.25}]))
    assert completion_logprobs(first.logprobs) == {
        "tokens": ["token_id:0"],
        "token_logprobs": [-0.5],
        "top_logprobs": [{"token_id:0": -0.5, "token_id:9": -1.0}],
        "text_offset": [0],
    }
    later = completion_logprobs(second.logprobs)
    assert second.token_ids == [1] and later["token_logprobs"] == [-0.25]
    assert later["text_offset"] == [len("token_id:0")]
