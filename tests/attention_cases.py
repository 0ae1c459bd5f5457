"""Input builders shared by the attention kernel tests (not a test module).

A paged cache is built the adversarial way: block 0 reserved, every sequence's blocks drawn
in random order, every row not holding a token of some sequence (including the tail of each
sequence's last block) filled with NaN, and block-table entries past a sequence's blocks set
to an out-of-range id, so a kernel that reads past ``kv_lens`` produces NaN or an error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FLOAT_DTYPES = [torch.bfloat16, torch.float16, torch.float32]

# (out atol, out rtol, lse atol) per dtype: bf16 and fp16 round the output (the bf16 paths
# keep P at fp32 accuracy: test_kernel_bf16_accuracy.py holds them to 1.5x correct
# rounding); fp32 only reorders fp32 sums.
TOLERANCES = {
    torch.bfloat16: (1.5e-2, 1.5e-2, 2e-3),
    torch.float16: (3e-3, 3e-3, 2e-3),
    torch.float32: (2e-5, 2e-5, 2e-5),
}


@dataclass(frozen=True)
class PagedInputs:
    q: torch.Tensor  # [T, H, W]
    kv_cache: torch.Tensor  # [NB, BS, W]
    block_table: torch.Tensor  # [B, M] int32
    kv_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    positions: torch.Tensor  # [T] int64
    scale: float
    kv_lora_rank: int

    def args(self) -> tuple:
        return (
            self.q,
            self.kv_cache,
            self.block_table,
            self.kv_lens,
            self.query_start_loc,
            self.positions,
            self.scale,
            self.kv_lora_rank,
        )


def paged_cache(
    rows_per_seq: list[torch.Tensor],  # each [L_b, W]
    block_size: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    extra_table_cols: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv_cache [NB, BS, W], block_table [B, M] int32) holding the rows, adversarially."""
    width = rows_per_seq[0].shape[1] if rows_per_seq else 1
    blocks = [math.ceil(r.shape[0] / block_size) for r in rows_per_seq]
    num_blocks = 1 + sum(blocks) + 1  # block 0 reserved, one spare
    cache = torch.full((num_blocks, block_size, width), math.nan, dtype=dtype)
    ids = (1 + torch.randperm(num_blocks - 1, generator=gen)).tolist()
    max_blocks = max(blocks, default=0) + extra_table_cols
    # Entries past a sequence's blocks are never read: make them invalid ids.
    table = torch.full((len(rows_per_seq), max_blocks), num_blocks + 7, dtype=torch.int32)
    for b, rows in enumerate(rows_per_seq):
        for i in range(blocks[b]):
            block = ids.pop()
            table[b, i] = block
            chunk = rows[i * block_size : (i + 1) * block_size]
            cache[block, : chunk.shape[0]] = chunk.to(dtype)
    return cache, table


def make_paged(
    kv_lens: list[int],
    q_lens: list[int],
    num_heads: int,
    kv_lora_rank: int,
    rope_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int,
    position_mode: str = "decode",
) -> PagedInputs:
    """position_mode: "decode" (the new tokens are the last q_len of kv_len), "context"
    (positions at or past kv_len: the context half of a split), "random" (anything from -1,
    i.e. no visible key, to past the end)."""
    gen = torch.Generator().manual_seed(seed)
    width = kv_lora_rank + rope_dim
    rows = [torch.randn(n, width, generator=gen) for n in kv_lens]
    cache, table = paged_cache(rows, block_size, dtype, gen)
    positions = []
    for kv_len, q_len in zip(kv_lens, q_lens, strict=True):
        for i in range(q_len):
            if position_mode == "decode":
                positions.append(kv_len - q_len + i)
            elif position_mode == "context":
                positions.append(kv_len + i)
            else:
                positions.append(int(torch.randint(-1, kv_len + 3, (1,), generator=gen)))
    num_tokens = sum(q_lens)
    q = torch.randn(num_tokens, num_heads, width, generator=gen).to(dtype)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    return PagedInputs(
        q=q,
        kv_cache=cache,
        block_table=table,
        kv_lens=torch.tensor(kv_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        positions=torch.tensor(positions, dtype=torch.int64),
        scale=width**-0.5,
        kv_lora_rank=kv_lora_rank,
    )


@dataclass(frozen=True)
class VarlenInputs:
    q: torch.Tensor
    k_nope: torch.Tensor
    k_pe: torch.Tensor
    v: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    scale: float
    causal: bool

    def args(self) -> tuple:
        return (
            self.q,
            self.k_nope,
            self.k_pe,
            self.v,
            self.cu_seqlens_q,
            self.cu_seqlens_k,
            self.scale,
            self.causal,
        )


def _cu(lens: list[int]) -> torch.Tensor:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


def make_varlen(
    q_lens: list[int],
    k_lens: list[int],
    num_heads: int,
    p: int,
    r: int,
    v: int,
    dtype: torch.dtype,
    causal: bool,
    seed: int,
    strided: bool = False,
) -> VarlenInputs:
    gen = torch.Generator().manual_seed(seed)
    t, s = sum(q_lens), sum(k_lens)

    def rand(*shape: int) -> torch.Tensor:
        x = torch.randn(*shape, generator=gen).to(dtype)
        if strided:  # rows of a wider buffer: last dim contiguous, others not
            wide = torch.zeros(*shape[:-1], shape[-1] + 3, dtype=dtype)
            wide[..., 3:] = x
            x = wide[..., 3:]
        return x

    return VarlenInputs(
        q=rand(t, num_heads, p + r),
        k_nope=rand(s, num_heads, p),
        k_pe=rand(s, r),
        v=rand(s, num_heads, v),
        cu_seqlens_q=_cu(q_lens),
        cu_seqlens_k=_cu(k_lens),
        scale=(p + r) ** -0.5,
        causal=causal,
    )


def assert_attention_close(out, lse, ref_out, ref_lse, dtype) -> None:
    atol, rtol, lse_atol = TOLERANCES[dtype]
    assert out.dtype == ref_out.dtype and out.shape == ref_out.shape
    assert lse.dtype == torch.float32 and lse.shape == ref_lse.shape and lse.is_contiguous()
    assert out.is_contiguous()
    torch.testing.assert_close(lse, ref_lse, atol=lse_atol, rtol=0, equal_nan=False)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=atol, rtol=rtol)
