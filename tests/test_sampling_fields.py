"""The engine's side of issue 20: every SamplingParams value is servable, prompt logprobs,
n/best_of copies sharing the prompt's blocks, penalties/bias/min_tokens against a slow
obvious reference, and failure isolation (one request's failure fails it alone)."""

from __future__ import annotations

import math

import pytest
import torch

import mlafx
from mlafx.runtime.request import Request
from mlafx.runtime.sampler import SamplingError, process_logits, sample
from mlafx.runtime.sampling_params import RequestMetrics
from tests.tiny_models import tiny_llm

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]


@pytest.fixture(scope="module")
def llm():
    return tiny_llm(num_kv_blocks=256)


def greedy(llm, prompt, n=6):
    params = mlafx.SamplingParams(max_tokens=n, ignore_eos=True)
    return llm.generate([prompt], params)[0].outputs[0].token_ids


def test_prompt_logprobs_equal_the_next_token_distribution_at_each_prefix(llm):
    params = mlafx.SamplingParams(max_tokens=0, prompt_logprobs=3)
    out = llm.generate([PROMPT], params)[0]
    assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(PROMPT)
    for i in range(1, len(PROMPT)):
        ref = llm.generate([PROMPT[:i]], mlafx.SamplingParams(max_tokens=1, logprobs=256))[0]
        dist = ref.outputs[0].logprobs[0]
        entry = out.prompt_logprobs[i]
        assert math.isclose(entry[PROMPT[i]], dist[PROMPT[i]], abs_tol=1e-5)
        top3 = sorted(dist, key=lambda t: -dist[t])[:3]
        assert set(top3) <= set(entry) <= set(top3) | {PROMPT[i]}


def test_prompt_logprobs_survive_chunked_prefill_and_prefix_hits(llm):
    whole = llm.generate([PROMPT], mlafx.SamplingParams(max_tokens=2, prompt_logprobs=1))[0]
    chunked = tiny_llm(max_num_batched_tokens=3, num_kv_blocks=256)
    chunked.generate([PROMPT], mlafx.SamplingParams(max_tokens=1))  # the prompt is cached now
    again = chunked.generate([PROMPT], mlafx.SamplingParams(max_tokens=2, prompt_logprobs=1))[0]
    assert again.num_cached_tokens == 0  # prompt logprobs compute the whole prompt
    assert again.outputs[0].token_ids == whole.outputs[0].token_ids
    for a, b in zip(again.prompt_logprobs[1:], whole.prompt_logprobs[1:], strict=True):
        assert a.keys() == b.keys()
        assert all(math.isclose(a[t], b[t], abs_tol=1e-5) for t in a)


def test_copies_share_the_prompt_and_seeds_follow_vllm(llm):
    prompt = [20 + i for i in range(13)]
    before = llm.get_metrics()["computed_prompt_tokens"]
    params = mlafx.SamplingParams(max_tokens=5, n=3, temperature=1.0, seed=7, ignore_eos=True)
    out = llm.generate([prompt], params)[0]
    computed = llm.get_metrics()["computed_prompt_tokens"] - before
    assert computed == len(prompt) + 2  # the copies compute only the last prompt token
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for i, completion in enumerate(out.outputs):
        alone = mlafx.SamplingParams(max_tokens=5, temperature=1.0, seed=7 + i, ignore_eos=True)
        assert completion.token_ids == llm.generate([prompt], alone)[0].outputs[0].token_ids


def test_best_of_keeps_the_most_likely_copies(llm):
    params = mlafx.SamplingParams(
        max_tokens=4, n=2, best_of=5, temperature=1.0, seed=1, ignore_eos=True
    )
    out = llm.generate([PROMPT], params)[0]
    every = llm.generate([PROMPT], mlafx.SamplingParams(**{**_fields(params), "n": 5}))[0]
    ranked = sorted(every.outputs, key=lambda c: -c.cumulative_logprob)[:2]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in ranked]
    assert [c.index for c in out.outputs] == [0, 1]


def _fields(params: mlafx.SamplingParams) -> dict:
    return {
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "seed": params.seed,
        "ignore_eos": params.ignore_eos,
    }


@pytest.mark.parametrize(
    "extreme",
    [
        dict(temperature=1e-39),
        dict(temperature=1e-300),
        dict(temperature=1.0, top_p=5e-324),
        dict(temperature=1e-5, top_p=1e-45, top_k=1),
        dict(temperature=1e30),
    ],
)
def test_every_admitted_value_samples(llm, extreme):
    params = mlafx.SamplingParams(max_tokens=4, ignore_eos=True, **extreme)
    out = llm.generate([PROMPT], params)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    if extreme.get("temperature", 1) < 1e-5 or extreme.get("top_p", 1) < 1e-30:
        assert out.token_ids == greedy(llm, PROMPT, 4)


def test_bounds_are_checked():
    for bad in (
        dict(temperature=math.nan),
        dict(temperature=math.inf),
        dict(top_p=math.nan),
        dict(seed=2**64),
        dict(n=0),
        dict(n=3, best_of=2),
        dict(presence_penalty=2.5),
        dict(repetition_penalty=0),
        dict(logit_bias={3: 101}),
        dict(min_tokens=5, max_tokens=4),
        dict(max_tokens=-1),
    ):
        with pytest.raises(ValueError):
            mlafx.SamplingParams(**bad)


def reference_processing(logits, prompt, output, params, eos):
    """The obvious loops."""
    out = logits.clone()
    for token in set(prompt + output):
        if params.repetition_penalty != 1.0:
            value = out[token]
            out[token] = (
                value / params.repetition_penalty
                if value > 0
                else value * params.repetition_penalty
            )
    for token in set(output):
        out[token] -= output.count(token) * params.frequency_penalty + params.presence_penalty
    for token, bias in (params.logit_bias or {}).items():
        out[token] += bias
    if len(output) < params.min_tokens:
        for token in set(params.stop_token_ids) | set(eos):
            out[token] = -math.inf
    return out


def test_logit_processing_matches_the_reference():
    torch.manual_seed(0)
    params = mlafx.SamplingParams(
        max_tokens=8,
        presence_penalty=0.7,
        frequency_penalty=-0.4,
        repetition_penalty=1.3,
        logit_bias={3: 5.0, 9: -100.0},
        min_tokens=4,
        stop_token_ids=(4,),
    )
    prompt, output = [1, 2, 3, 3, 7], [7, 7, 8, 2]
    request = Request("0", prompt, params, RequestMetrics(0.0), output_token_ids=list(output))
    logits = torch.randn(16)
    got = process_logits(logits, request, eos_token_ids=[1])
    want = reference_processing(logits, prompt, output, params, eos=[1])
    assert torch.allclose(got, want)  # min_tokens met: nothing masked
    request.output_token_ids = output[:2]
    got = process_logits(logits, request, eos_token_ids=[1])
    want = reference_processing(logits, prompt, output[:2], params, eos=[1])
    assert torch.equal(torch.isinf(got), torch.isinf(want)) and got[1] == got[4] == -math.inf
    assert torch.allclose(got[torch.isfinite(got)], want[torch.isfinite(want)])


def test_a_tiny_repetition_penalty_keeps_the_distribution_finite():
    """Dividing a positive logit by 5.5e-263 overflows float32: the seen token gets the
    largest finite logit, so it is drawn (and sampled without a SamplingError)."""
    params = mlafx.SamplingParams(max_tokens=4, temperature=0.7, repetition_penalty=5.5e-263)
    request = Request("0", [3, 5], params, RequestMetrics(0.0))
    logits = torch.linspace(-2.0, 2.0, 16)
    logits[3] = 0.5
    got = process_logits(logits, request, eos_token_ids=[])
    assert torch.isfinite(got).all()
    assert got[3] == torch.finfo(torch.float32).max and got.argmax() == 3
    (drawn,) = sample(logits[None], [request])
    assert not isinstance(drawn, SamplingError) and drawn.token_id == 3


def test_penalties_and_bias_change_what_is_drawn(llm):
    biased = mlafx.SamplingParams(max_tokens=5, logit_bias={42: 100.0}, ignore_eos=True)
    assert llm.generate([PROMPT], biased)[0].outputs[0].token_ids == [42] * 5
    repeat = mlafx.SamplingParams(
        max_tokens=5, logit_bias={42: 10.0}, frequency_penalty=2.0, presence_penalty=2.0
    )
    tokens = llm.generate([PROMPT], repeat)[0].outputs[0].token_ids
    assert tokens[0] == 42 and tokens.count(42) < 5
    eos_first = mlafx.SamplingParams(max_tokens=6, min_tokens=3, logit_bias={1: 100.0})
    out = llm.generate([PROMPT], eos_first)[0].outputs[0]
    assert out.token_ids[:3] != [1, 1, 1] and 1 not in out.token_ids[:3]
    assert out.token_ids[3] == 1 and out.finish_reason == "stop"


class FailOn:
    """Wraps a step: raises whenever the batch holds ``token`` (a request that breaks it)."""

    def __init__(self, step, token: int) -> None:
        self.step, self.token = step, token
        self.reads_key_rows = step.reads_key_rows

    def __call__(self, input_ids, *args):
        if bool((input_ids == self.token).any()):
            raise RuntimeError("a kernel failed")
        return self.step(input_ids, *args)


def test_a_failing_request_fails_alone(llm):
    prompts = [[30 + i, 31 + i, 32 + i] for i in range(4)]
    want = [greedy(llm, p) for p in prompts]
    engine = tiny_llm(num_kv_blocks=256)
    engine.engine.step_fn = FailOn(engine.engine.step_fn, 250)
    params = mlafx.SamplingParams(max_tokens=6, ignore_eos=True)
    outs = engine.generate(prompts[:2] + [[250, 3, 4]] + prompts[2:], params)
    bad = outs.pop(2).outputs[0]
    assert bad.finish_reason == "error" and "a kernel failed" in bad.error
    assert [o.outputs[0].token_ids for o in outs] == want
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks


def test_non_finite_logits_fail_their_row_only(llm):
    engine = tiny_llm(num_kv_blocks=256)
    inner = engine.engine.step_fn

    def nan_row(input_ids, positions, caches, meta, logits_indices):
        logits = inner(input_ids, positions, caches, meta, logits_indices)
        poisoned = (input_ids[logits_indices] == 249).nonzero().flatten()
        logits[poisoned, 0] = float("nan")
        return logits

    nan_row.reads_key_rows = inner.reads_key_rows
    engine.engine.step_fn = nan_row
    params = mlafx.SamplingParams(max_tokens=6, ignore_eos=True)
    outs = engine.generate([PROMPT, [3, 249], [40, 41]], params)
    assert outs[1].outputs[0].finish_reason == "error"
    assert outs[0].outputs[0].token_ids == greedy(llm, PROMPT)
    assert outs[2].outputs[0].token_ids == greedy(llm, [40, 41])


def test_compiled_step_scores_the_prompt_like_the_reference(llm):
    """Prompt logprobs ask the step for a logits row per prompt position: the compiled step's
    dynamic logits axis serves them as the reference model does."""
    compiled = tiny_llm(compile=True)
    params = mlafx.SamplingParams(max_tokens=3, prompt_logprobs=2)
    prompts = [PROMPT, PROMPT[:4]]
    outputs = zip(compiled.generate(prompts, params), llm.generate(prompts, params), strict=True)
    for got, want in outputs:
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        for i in range(1, len(got.prompt_token_ids)):
            token = got.prompt_token_ids[i]
            assert math.isclose(
                got.prompt_logprobs[i][token], want.prompt_logprobs[i][token], abs_tol=1e-4
            )
