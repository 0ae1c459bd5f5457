"""Input builders and checks shared by the DSA kernel tests (not a test module).

Caches are built by ``attention_cases.paged_cache``: block 0 reserved, blocks permuted, every
row that is not a token of some sequence NaN, unused block-table entries invalid ids -- a
kernel that reads past ``kv_lens`` produces NaN scores (or an error), which the comparisons
catch. ``values="integer"`` draws small integers (and weights in halves), so every score is
exact in fp32 whatever the summation order: selections then compare exactly, ties included.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from attention_cases import paged_cache

from mlafx.kernels.dsa_reference import dsa_visible_scores_ref


@dataclass(frozen=True)
class IndexerInputs:
    q: torch.Tensor  # [T, Hi, Di]
    weights: torch.Tensor  # [T, Hi] float32
    index_cache: torch.Tensor  # [NB, BS, Di]
    block_table: torch.Tensor  # [B, M] int32
    kv_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    positions: torch.Tensor  # [T] int64
    topk: int

    def args(self) -> tuple:
        return (
            self.q,
            self.weights,
            self.index_cache,
            self.block_table,
            self.kv_lens,
            self.query_start_loc,
            self.positions,
            self.topk,
        )


def query_positions(
    kv_lens: list[int], q_lens: list[int], mode: str, gen: torch.Generator
) -> list[int]:
    """mode: "decode" (the new tokens are the last q_len of kv_len: causal prefill when
    q_len > 1), "random" (anything from -1, i.e. nothing visible, to past the end)."""
    positions = []
    for kv_len, q_len in zip(kv_lens, q_lens, strict=True):
        for i in range(q_len):
            if mode == "decode":
                positions.append(kv_len - q_len + i)
            else:
                positions.append(int(torch.randint(-1, kv_len + 3, (1,), generator=gen)))
    return positions


def starts(q_lens: list[int]) -> torch.Tensor:
    out = [0]
    for n in q_lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


def make_indexer(
    kv_lens: list[int],
    q_lens: list[int],
    heads: int,
    dim: int,
    block_size: int,
    dtype: torch.dtype,
    topk: int,
    seed: int,
    *,
    mode: str = "decode",
    values: str = "random",
) -> IndexerInputs:
    """values: "random" (normal), "integer" (exact scores, many ties), "duplicate" (integer,
    every sequence's rows drawn from 3 distinct rows: equal scores), "zero_weights" (every
    score 0: the earliest positions win)."""
    gen = torch.Generator().manual_seed(seed)
    if mode == "decode":
        q_lens = [min(q, n) for q, n in zip(q_lens, kv_lens, strict=True)]
    num_tokens = sum(q_lens)

    def draw(*shape: int) -> torch.Tensor:
        if values == "random":
            return torch.randn(*shape, generator=gen)
        return torch.randint(-3, 4, shape, generator=gen).float()

    rows = [draw(n, dim) for n in kv_lens]
    if values == "duplicate":
        rows = [r[torch.randint(0, 3, (r.shape[0],), generator=gen) % max(1, r.shape[0])]
                if r.shape[0] else r for r in rows]  # fmt: skip
    cache, table = paged_cache(rows, block_size, dtype, gen)
    weights = draw(num_tokens, heads) / 2
    if values == "zero_weights":
        weights.zero_()
    return IndexerInputs(
        q=draw(num_tokens, heads, dim).to(dtype),
        weights=weights.float(),
        index_cache=cache,
        block_table=table,
        kv_lens=torch.tensor(kv_lens, dtype=torch.int32),
        query_start_loc=starts(q_lens),
        positions=torch.tensor(query_positions(kv_lens, q_lens, mode, gen), dtype=torch.int64),
        topk=topk,
    )


def assert_selection_valid(selected: torch.Tensor, scores: list[torch.Tensor], topk: int) -> None:
    """Shape, dtype, ascending distinct visible positions, then -1 padding to topk."""
    assert selected.dtype == torch.int64 and selected.shape == (len(scores), topk)
    for t, s in enumerate(scores):
        expected = min(topk, s.numel())
        row = selected[t]
        assert torch.all(row[expected:] == -1), (t, row)
        picked = row[:expected]
        assert torch.all((picked >= 0) & (picked < s.numel())), (t, row)
        assert torch.all(picked[1:] > picked[:-1]), (t, row)


def assert_selection_tie_aware(
    selected: torch.Tensor, inputs: IndexerInputs, reference: torch.Tensor, rel_tol: float
) -> None:
    """Where scores are not exact in fp32: every position the kernel and the reference disagree
    on must score (in float64) within rel_tol x the query's score magnitude of the k-th best."""
    scores = dsa_visible_scores_ref(*inputs.args()[:7])
    magnitude = dsa_visible_scores_ref(
        inputs.q.abs(), inputs.weights.abs(), *_abs_cache_args(inputs)
    )
    assert_selection_valid(selected, scores, inputs.topk)
    for t, s in enumerate(scores):
        ours = {p for p in selected[t].tolist() if p != -1}
        ref = {p for p in reference[t].tolist() if p != -1}
        if ours == ref:
            continue
        kth = s[sorted(ref)].min()
        tol = rel_tol * float(magnitude[t].max())
        for p in ours ^ ref:
            assert abs(float(s[p] - kth)) <= tol, (t, p, float(s[p]), float(kth), tol)


def _abs_cache_args(inputs: IndexerInputs) -> tuple:
    return (
        inputs.index_cache.abs(),
        inputs.block_table,
        inputs.kv_lens,
        inputs.query_start_loc,
        inputs.positions,
    )
