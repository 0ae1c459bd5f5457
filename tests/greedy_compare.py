"""Tie-aware comparison of greedy generations from two different computations.

Random weights make near-ties between the top two logits common; a first difference at a
position whose top-two log-probabilities (in the reference) lie within ``tie_tol`` is a
tie, reported as such, and the tokens after it are not compared (their prefixes differ).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Comparison:
    compared: int  # positions whose tokens and logprobs were compared
    tie_at: int | None  # position of a near-tie where the sequences diverged


def compare_greedy(
    ref_tokens: list[int],
    ref_logprobs: torch.Tensor,  # [N, vocab] float32 log-softmax of the reference's logits
    got_tokens: list[int],
    got_token_logprobs: list[float],  # log-probability of each of got_tokens
    *,
    logprob_tol: float = 1e-4,
    tie_tol: float = 1e-4,
    label: str = "",
) -> Comparison:
    assert len(got_tokens) == len(ref_tokens), (
        f"{label}: lengths {len(got_tokens)} vs {len(ref_tokens)}"
    )
    for i, (want, got) in enumerate(zip(ref_tokens, got_tokens, strict=True)):
        if want != got:
            top2 = ref_logprobs[i].topk(2).values
            gap = float(top2[0] - top2[1])
            assert gap <= tie_tol, (
                f"{label}: token {i} differs ({got} vs reference {want}) and is no tie: the "
                f"reference's top-two log-probabilities are {gap:.3g} apart"
            )
            print(f"{label}: near-tie at position {i} (top-two gap {gap:.2e}); stop comparing")
            return Comparison(compared=i, tie_at=i)
        want_lp = float(ref_logprobs[i, want])
        assert abs(got_token_logprobs[i] - want_lp) <= logprob_tol, (
            f"{label}: log-probability of token {i} is {got_token_logprobs[i]:.6f}, reference "
            f"{want_lp:.6f}"
        )
    return Comparison(compared=len(ref_tokens), tie_at=None)


def random_transformers_model(config, model_class, seed: int) -> torch.nn.Module:
    """``model_class(config)`` with seeded random weights in eval mode; routers' correction
    biases (zero-initialised, which would hide their bugs) drawn from [-0.3, 0.3]."""
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.uniform_(-0.3, 0.3)
    return model


def transformers_greedy(
    model, prompt: list[int], new_tokens: int
) -> tuple[list[int], torch.Tensor]:
    """transformers' own greedy generation of exactly ``new_tokens`` tokens after ``prompt``:
    (tokens, [new_tokens, vocab] float32 log-softmax of its logits), the reference rows
    ``compare_greedy`` takes."""
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    logprobs = torch.log_softmax(torch.stack(out.logits, dim=1)[0].float(), dim=-1)
    return out.sequences[0, len(prompt) :].tolist(), logprobs
