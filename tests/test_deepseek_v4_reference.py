"""mlafx's DeepSeek-V4 reference model against transformers' cache-free forward (the whole
sequence recomputed: the reference semantics, see ``mlafx.models.deepseek_v4``), through the
paged step: whole prefills, chunk edges inside compression windows, decodes, several
sequences in one step, prefix hits sharing blocks, several block sizes; and greedy generation
(tie-aware). Each on the reference's dense attention and on mlafx's attention ops (the
engine's path: ``sparse``)."""

from __future__ import annotations

import pytest
import torch
from greedy_compare import compare_greedy
from v4_cases import PagedRun, mlafx_v4, reference_logprobs, transformers_v4

TOL = 1e-4


@pytest.fixture(scope="module")
def models():
    hf = transformers_v4(seed=0)
    return hf, mlafx_v4(hf)


@pytest.fixture(params=[False, True], ids=["dense", "sparse"])
def sparse(request) -> bool:
    return request.param


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _assert_close(got: torch.Tensor, want: torch.Tensor, label: str) -> None:
    err = (got - want).abs().amax(-1)
    assert float(err.max()) < TOL, (
        f"{label}: position {int(err.argmax())} off by {float(err.max()):.3g}"
    )


@pytest.mark.parametrize("block_size", [4, 16, 32])
@pytest.mark.parametrize(
    "chunks",
    [[70], [5, 13, 1, 1, 30, 20], [3, 14, 1, 2, 17, 33], [100, 3, 61, 1, 1, 124]],
    ids=["whole", "edges-in-windows", "odd-edges", "290-tokens"],
)
def test_chunked_prefill_matches_the_cache_free_forward(models, block_size, chunks, sparse):
    hf, model = models
    ids = _ids(sum(chunks), seed=1)
    got = PagedRun(model, block_size, sparse=sparse).run(ids, chunks)
    _assert_close(got, reference_logprobs(hf, ids), f"chunks {chunks}, block size {block_size}")


def test_decode_one_token_per_step_matches(models, sparse):
    hf, model = models
    ids = _ids(80, seed=2)
    got = PagedRun(model, 16, sparse=sparse).run(ids, [1] * 80)
    _assert_close(got, reference_logprobs(hf, ids), "decode")


def test_sequences_sharing_steps_do_not_see_each_other(models, sparse):
    """Two sequences in the same steps: one prefilled in chunks while the other decodes."""
    hf, model = models
    a, b = _ids(60, seed=3), _ids(45, seed=4)
    run = PagedRun(model, 8, sparse=sparse)
    ba, bb = run.new_blocks(60), run.new_blocks(45)
    out_a, out_b = [], []
    done_a, done_b = 0, 0
    for ca, cb in [(25, 30), (1, 7), (1, 1), (20, 1), (13, 6)]:
        la, lb = run.step([(a[: done_a + ca], done_a, ba), (b[: done_b + cb], done_b, bb)])
        out_a.append(la), out_b.append(lb)
        done_a, done_b = done_a + ca, done_b + cb
    assert (done_a, done_b) == (60, 45)
    _assert_close(torch.cat(out_a), reference_logprobs(hf, a), "sequence a")
    _assert_close(torch.cat(out_b), reference_logprobs(hf, b), "sequence b")


@pytest.mark.parametrize("shared_blocks", [4, 5, 8], ids=["aligned", "mid-window", "two-windows"])
def test_prefix_hit_reads_shared_blocks_and_never_writes_them(models, shared_blocks, sparse):
    """Sequence b reuses a's first blocks (block size 4: 16, 20 or 32 tokens; HCA windows are
    16), then diverges; a's blocks are unchanged by b and b matches its own reference."""
    hf, model = models
    run = PagedRun(model, 4, sparse=sparse)
    a = _ids(50, seed=5)
    run.run(a, [50])
    a_blocks = list(range(1, 1 + 13))
    shared = shared_blocks * 4
    before = [c.clone() for c in run.caches]
    b = a[:shared] + _ids(40, seed=6)
    got = run.run(b, [7, 1, 32], blocks=a_blocks[:shared_blocks], context=shared)
    _assert_close(got, reference_logprobs(hf, b)[shared:], "prefix hit")
    for c, old in zip(run.caches, before, strict=True):
        per_block = c.shape[1]
        assert torch.equal(c[1 : 1 + 13], old[1 : 1 + 13]), f"a shared block changed ({per_block})"


_GREEDY: dict[tuple[int, ...], tuple[list[int], list[torch.Tensor]]] = {}


def _greedy_reference(hf, prompt: list[int], new: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy continuation (ids, each step's log-softmax), once per prompt for
    both attention paths."""
    key = (*prompt, new)
    if key not in _GREEDY:
        ids, lps = list(prompt), []
        for _ in range(new):
            lp = reference_logprobs(hf, ids)[-1]
            lps.append(lp)
            ids.append(int(lp.argmax()))
        _GREEDY[key] = (ids, lps)
    return _GREEDY[key]


@pytest.mark.parametrize("prompt_len", [1, 37, 150])
def test_greedy_generation_matches_transformers(models, prompt_len, sparse):
    hf, model = models
    prompt, new = _ids(prompt_len, seed=7 + prompt_len), 30
    ref_ids, ref_lps = _greedy_reference(hf, prompt, new)
    run = PagedRun(model, 16, sparse=sparse)
    blocks = run.new_blocks(prompt_len + new)
    ids, ctx, got, got_lps = list(prompt), 0, [], []
    for _ in range(new):
        lp = run.step([(ids, ctx, blocks)])[0][-1]
        ctx = len(ids)
        tok = int(lp.argmax())
        got.append(tok), got_lps.append(float(lp[tok]))
        ids.append(tok)
    compare_greedy(
        ref_ids[prompt_len:], torch.stack(ref_lps), got, got_lps, label=f"prompt {prompt_len}"
    )
