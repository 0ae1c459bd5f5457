"""DeepSeek-V4 served by ``LLM``, compiled (``compile/v4_compiled_step.py``) and eagerly (the
reference model through the engine loop): greedy tokens and logprobs against transformers'
cache-free forward, with batching, chunk edges inside compression windows, prefix hits (whole
blocks and copied leading rows), preemption and a KV-store reload in the mix. The compiled
cases share block size 8, so that the module compiles each layer kind once.

The reference is transformers' forward over each prompt plus the tokens mlafx drew, in one
pass: row ``i`` is the exact next-token distribution after mlafx's first ``i`` tokens, so every
drawn token is checked (its log-probability within 1e-4; it is the reference's top token, or
second at a near-tie within 1e-4) even after a near-tie."""

from __future__ import annotations

import random

import pytest
import torch
from v4_cases import reference_logprobs, transformers_v4
from v4_checkpoints import WIDTHS, write_deepseek_checkpoint, write_dequantized_copy

from mlafx import LLM, SamplingParams
from mlafx.config.deepseek_v4 import DeepseekV4Config
from mlafx.config.model_config import load_hf_config_dict
from mlafx.runtime.block_hash import cache_fingerprint, full_block_hashes
from mlafx.runtime.kv_connector import make_connector
from mlafx.runtime.token_rows import block_bytes
from tests.memory_connector import InMemoryConnector

TOL = 1e-4


@pytest.fixture(scope="module")
def hf_model():
    return transformers_v4(seed=0)


@pytest.fixture(scope="module")
def checkpoint(hf_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("v4")
    hf_model.save_pretrained(path)  # DeepSeek's names under ``model.``, as transformers writes
    return path


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(97) for _ in range(n)] for n in lengths]


# The engine's two steps: the compiled layers and the eager reference model.
PATHS = pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])


def _llm(checkpoint, compiled: bool = False, **options) -> LLM:
    return LLM(str(checkpoint), compile=compiled, dtype="float32", progress=False, **options)


def _generate(llm: LLM, prompts: list[list[int]], max_tokens: int = 6):
    return llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=1))


def _check(hf_model, prompts, outputs) -> None:
    for prompt, out in zip(prompts, outputs, strict=True):
        got = out.outputs[0]
        assert got.finish_reason == "length", got.error
        tokens = got.token_ids
        ref = reference_logprobs(hf_model, prompt + tokens)[len(prompt) - 1 : -1]
        for i, (token, top) in enumerate(zip(tokens, got.logprobs, strict=True)):
            best = ref[i].topk(2)
            if token != int(best.indices[0]):
                gap = float(best.values[0] - best.values[1])
                assert token == int(best.indices[1]) and gap <= TOL, (
                    f"prompt of {len(prompt)}: token {i} is {token}, the reference's top is "
                    f"{int(best.indices[0])} ({gap:.3g} ahead): no near-tie"
                )
            err = abs(top[token] - float(ref[i, token]))
            assert err <= TOL, f"prompt of {len(prompt)}: token {i}'s logprob off by {err:.3g}"


@PATHS
def test_a_batch_with_chunk_edges_inside_compression_windows(hf_model, checkpoint, compiled):
    """Prompts of 1 to 290 tokens in one batch, prefilled 37 tokens a step (CSA windows of 4,
    HCA windows of 16, a sliding window of 8: most chunk edges fall inside all three)."""
    prompts = _prompts([1, 5, 23, 64, 130, 290], seed=0)
    llm = _llm(checkpoint, compiled, block_size=8, num_kv_blocks=160, max_num_batched_tokens=37)
    _check(hf_model, prompts, _generate(llm, prompts))


@pytest.mark.parametrize("block_size", [4, 32])
def test_block_sizes_below_and_above_the_compression_rates(hf_model, checkpoint, block_size):
    """Block 4: one pool entry per block (HCA's 16-token windows span four blocks); block 32:
    eight CSA entries and two HCA entries per block."""
    prompts = _prompts([3, 47, 100], seed=1)
    llm = _llm(checkpoint, block_size=block_size, num_kv_blocks=4096 // block_size)
    _check(hf_model, prompts, _generate(llm, prompts))


@PATHS
def test_prefix_hits_whole_blocks_and_copied_rows(hf_model, checkpoint, compiled):
    """A 100-token prompt first; then prompts that share its first 96 tokens (12 whole blocks
    of 8), its first 53 (6 whole blocks, then 5 rows copied from its 7th: one closed CSA
    entry with them) and the whole of it."""
    (base,) = _prompts([100], seed=2)
    llm = _llm(checkpoint, compiled, block_size=8, num_kv_blocks=200)
    _check(hf_model, [base], _generate(llm, [base]))
    rest = _prompts([20, 30], seed=3)
    followers = [base[:96] + rest[0], base[:53] + rest[1], base + [7]]
    before = llm.engine.stats.prefix_cache_hit_tokens
    _check(hf_model, followers, _generate(llm, followers))
    assert llm.engine.stats.prefix_cache_hit_tokens - before >= 96 + 53 + 100


@PATHS
def test_preemption_recomputes_without_changing_a_token(hf_model, checkpoint, compiled):
    """A cache too small for the batch: requests are preempted and recomputed."""
    prompts = _prompts([40, 45, 50, 55], seed=4)
    llm = _llm(checkpoint, compiled, block_size=8, num_kv_blocks=26, enable_prefix_caching=False)
    outputs = _generate(llm, prompts, max_tokens=24)
    assert llm.engine.stats.num_preemptions > 0
    _check(hf_model, prompts, outputs)


def _peak_token_blocks(llm: LLM) -> list[int]:
    """The most token blocks held after any schedule of ``llm``'s engine, updated as it runs."""
    scheduler, rows = llm.engine.scheduler, llm.engine.token_rows
    assert rows is not None  # V4 without a KV connector keeps its token rows apart
    peak = [0]
    schedule = scheduler.schedule

    def tracked():
        batch = schedule()
        peak[0] = max(peak[0], rows.num_held)
        return batch

    scheduler.schedule = tracked  # type: ignore[method-assign]
    return peak


@PATHS
def test_token_rows_past_the_window_are_dropped(hf_model, checkpoint, compiled):
    """Two sequences at a time, each holding its token rows from its first read on (the model
    reads at most 15 tokens back: 2 blocks of 8, plus the blocks of the step): 14 token blocks
    for 160 cache blocks, whatever the prompts' lengths. Sent again after the others, the 290-
    token prompt still finds its last blocks' token rows (a full hit); the 130-token one,
    whose rows the later prompts took, reuses none; its recomputed blocks keep their rows and
    take the prefix over, so sent a third time it hits again. Every time the same tokens."""
    prompts = _prompts([1, 5, 23, 64, 130, 290], seed=0)
    llm = _llm(
        checkpoint, compiled, block_size=8, num_kv_blocks=160, max_num_batched_tokens=37,
        max_num_seqs=2,
    )  # fmt: skip
    engine = llm.engine
    assert engine.token_rows is not None and engine.token_rows.num_blocks == 2 * 4 + 5 + 1
    kinds = zip(engine.kv_caches, engine.token_caches, strict=True)
    assert {c.shape[0] for c, token in kinds if token} == {14} and engine.kv_caches[-1].shape[
        0
    ] == 160
    peak = _peak_token_blocks(llm)
    outputs = _generate(llm, prompts)
    _check(hf_model, prompts, outputs)
    assert 8 <= peak[0] <= 13  # both sequences hold rows; never all 290 tokens' 37 blocks
    hits = []
    for i in (5, 4, 4):  # the 290-token prompt, then the 130-token one twice
        before = engine.stats.prefix_cache_hit_tokens
        (again,) = _generate(llm, [prompts[i]])
        hits.append(engine.stats.prefix_cache_hit_tokens - before)
        assert again.outputs[0].token_ids == outputs[i].outputs[0].token_ids
    assert hits == [289, 0, 129]
    assert engine.token_rows.num_held == 0 and llm.get_metrics()["token_rows_usage"] == 0.0


def _token_block_bytes(checkpoint) -> int:
    """One token block of the test model at block size 8, float32."""
    cfg = DeepseekV4Config.from_hf_dict(load_hf_config_dict(checkpoint))
    return block_bytes(cfg, 8, "float32")[0]


@PATHS
def test_few_token_blocks_make_requests_wait_and_preempt(hf_model, checkpoint, compiled):
    """A cache memory whose half holds fewer token blocks than four sequences' windows: the
    token blocks, not the cache blocks, run out; requests wait and are preempted, and every
    token stays the reference's."""
    prompts = _prompts([30, 45, 60, 75, 20], seed=6)
    token_block_bytes = _token_block_bytes(checkpoint)
    llm = _llm(
        checkpoint, compiled, block_size=8, max_num_seqs=4, max_num_batched_tokens=37,
        kv_cache_memory=2 * 10 * token_block_bytes,
    )  # fmt: skip
    assert llm.engine.token_rows is not None and llm.engine.token_rows.num_blocks == 10
    assert llm.engine.blocks.num_blocks > 60
    outputs = _generate(llm, prompts, max_tokens=24)
    assert llm.engine.stats.num_preemptions > 0
    _check(hf_model, prompts, outputs)


def test_without_chunked_prefill_a_prompt_needing_more_token_rows_is_refused(hf_model, checkpoint):
    """A whole prompt is one step without chunked prefill: its rows from position 0 must fit
    the token blocks, or the request is refused up front (it would wait forever)."""
    token_block_bytes = _token_block_bytes(checkpoint)
    llm = _llm(
        checkpoint, block_size=8, enable_chunked_prefill=False, max_num_batched_tokens=37,
        kv_cache_memory=2 * 10 * token_block_bytes,
    )  # fmt: skip
    assert llm.engine.token_rows is not None and llm.engine.token_rows.num_blocks == 10
    long, short = _prompts([64, 40], seed=7)
    with pytest.raises(ValueError, match="needs 10 token-row blocks at once .* only 9"):
        _generate(llm, [long])
    _check(hf_model, [short], _generate(llm, [short]))


@PATHS
def test_a_kv_store_reload_in_a_new_engine(hf_model, checkpoint, tmp_path, compiled):
    """One engine saves a prompt's blocks to a disk store (chunks of 256 tokens); a fresh one
    loads them."""
    (prompt,) = _prompts([270], seed=5)
    store = f"disk:{tmp_path / 'store'}"
    first = _llm(checkpoint, compiled, block_size=8, num_kv_blocks=64, kv_connector=store)
    _generate(first, [prompt])
    first.close()
    second = _llm(checkpoint, compiled, block_size=8, num_kv_blocks=64, kv_connector=store)
    longer = prompt + [11, 12, 13]
    _check(hf_model, [longer], _generate(second, [longer]))
    assert second.engine.stats.external_hit_tokens == 256
    second.close()


@PATHS
def test_a_kv_store_with_token_rows_released_as_chunks_are_saved(
    hf_model, checkpoint, tmp_path, compiled
):
    """With a KV store, each whole chunk of a prompt (128 tokens: 16 blocks of 8) is saved as
    soon as it is computed, its token rows kept until then: one sequence at a time, 26 token
    blocks serve a 400-token prompt of 50 blocks. A fresh engine loads the three chunks (token
    rows only where its first step reads them); with the second chunk corrupt, the load falls
    short and the request is served from nothing, its tokens unchanged."""
    (prompt,) = _prompts([400], seed=8)
    store = tmp_path / "store"
    cfg = DeepseekV4Config.from_hf_dict(load_hf_config_dict(checkpoint))
    fingerprint = cache_fingerprint(cfg, "float32", 8)

    def engine() -> LLM:
        connector = make_connector(f"disk:{store}", fingerprint, 8, chunk_tokens=128)
        return _llm(
            checkpoint, compiled, block_size=8, num_kv_blocks=200, max_num_seqs=1,
            max_num_batched_tokens=37, kv_connector=connector,
        )  # fmt: skip

    first = engine()
    assert first.engine.token_rows is not None and first.engine.token_rows.num_blocks == 26
    peak = _peak_token_blocks(first)
    _generate(first, [prompt])
    assert peak[0] <= 25 and first.engine.token_rows.num_held == 0
    first.close()
    keys = full_block_hashes(prompt, 8)
    names = [f"{keys[c * 16 + 15].hex()}.c16.safetensors" for c in range(3)]
    chunks = [next(store.glob(f"*/{name}")) for name in names]
    longer = prompt + [11, 12, 13]
    second = engine()
    loaded = _generate(second, [longer])
    assert second.engine.stats.external_hit_tokens == 384
    _check(hf_model, [longer], loaded)
    second.close()
    data = bytearray(chunks[1].read_bytes())
    data[-7] ^= 0x01  # one bit of the last cache's rows
    chunks[1].write_bytes(bytes(data))
    third = engine()
    (again,) = _generate(third, [longer])
    assert third.engine.stats.external_hit_tokens == 0
    assert again.outputs[0].token_ids == loaded[0].outputs[0].token_ids
    third.close()


def test_a_connector_of_the_first_contract_keeps_every_token_row(hf_model, checkpoint):
    """A user's connector written before token rows had blocks of their own (one block-id
    list for every cache, ``save`` without ``first``) still serves V4: for it the engine keeps
    every token's rows, as it did before."""
    cfg = DeepseekV4Config.from_hf_dict(load_hf_config_dict(checkpoint))
    store = InMemoryConnector(cache_fingerprint(cfg, "float32", 8), 8)
    (prompt,) = _prompts([100], seed=9)
    first = _llm(checkpoint, block_size=8, num_kv_blocks=64, kv_connector=store)
    assert first.engine.token_rows is None
    _generate(first, [prompt])
    assert store.saves == 1
    second = _llm(checkpoint, block_size=8, num_kv_blocks=64, kv_connector=store)
    longer = prompt + [5, 6]
    _check(hf_model, [longer], _generate(second, [longer]))
    assert second.engine.stats.external_hit_tokens == 96


@PATHS
def test_an_fp8_and_fp4_checkpoint_against_transformers_on_its_dequantized_weights(
    tmp_path, compiled
):
    from transformers import DeepseekV4ForCausalLM

    written = write_deepseek_checkpoint(
        transformers_v4(seed=1, **WIDTHS), tmp_path / "fp8", quantized=True
    )
    write_dequantized_copy(written, tmp_path / "fp8", tmp_path / "ref")
    reference = DeepseekV4ForCausalLM.from_pretrained(tmp_path / "ref", dtype=torch.float32)
    prompts = _prompts([9, 61], seed=6)
    llm = _llm(
        tmp_path / "fp8", compiled, block_size=8, num_kv_blocks=64, max_num_batched_tokens=40
    )
    _check(reference.eval(), prompts, _generate(llm, prompts))


def test_the_compiled_engine_keeps_one_copy_of_each_weight(checkpoint):
    """A weight its packed copy replaced is released once its layer is loaded; the experts op
    and the attention ops read their weights as they are."""
    llm = _llm(checkpoint, True, block_size=8, num_kv_blocks=32)
    layer = llm.model.model.layers[1]
    assert layer.self_attn.q_b_proj.weight.is_meta and llm.model.lm_head.weight.is_meta
    assert not layer.mlp.experts.gate_up_proj.is_meta and not layer.self_attn.sinks.is_meta
    (out,) = _generate(llm, [[1, 2, 3]], max_tokens=2)
    assert len(out.outputs[0].token_ids) == 2


def test_dummy_bf16_weights_compiled_as_eager(checkpoint):
    """The default dtype (bfloat16) on dummy weights with overrides: the compiled step draws
    the eager step's tokens, their log-probabilities within bf16's rounding (a different
    token only at such a near-tie, after which the sequences part)."""
    prompt, outs = list(range(1, 40)), {}
    for compiled in (False, True):
        llm = LLM(
            str(checkpoint),
            compile=compiled,
            load_format="dummy",
            hf_overrides={"num_hidden_layers": 3},
            block_size=8,
            num_kv_blocks=32,
            progress=False,
        )
        assert llm.config.num_hidden_layers == 3 and llm.dtype == torch.bfloat16
        params = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=5)
        (out,) = llm.generate([prompt], params)
        outs[compiled] = out.outputs[0]
    eager, compiled_out = outs[False], outs[True]
    assert len(compiled_out.token_ids) == 4
    steps = zip(
        eager.token_ids, compiled_out.token_ids, eager.logprobs, compiled_out.logprobs, strict=True
    )
    for want, got, want_lp, got_lp in steps:
        for token in want_lp.keys() & got_lp.keys():
            assert abs(want_lp[token] - got_lp[token]) <= 0.05
        if got != want:
            assert want_lp[want] - want_lp.get(got, float("-inf")) <= 0.05
            break


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"compile": False, "quantization": "int8"}, "quantization"),
        ({"allow_unlowered": True}, "allow_unlowered"),
        ({"compile": False, "hf_overrides": {"num_hidden_layers": 2}}, "hf_overrides"),
        ({"compile": False, "block_size": 12}, "one must divide the other"),
        ({"tensor_parallel_size": 2}, "tensor_parallel_size"),
    ],
)
def test_what_is_not_served_yet_is_refused_by_name(checkpoint, options, named):
    with pytest.raises(ValueError, match=named):
        LLM(str(checkpoint), progress=False, **options)
