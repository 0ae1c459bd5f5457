"""`LLM`: the offline engine. Loads a model, owns the paged latent cache, and serves a
batch of prompts with continuous batching (see ``scheduler``), vLLM-style.

One step: schedule -> build the step's index tensors -> run the model -> sample -> append.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from mlafx.config import ModelConfig, check_fits_in_memory, kv_bytes_per_token
from mlafx.config.presets import PRESETS
from mlafx.models.loader import LoadFormat, build_model, torch_dtype
from mlafx.runtime.block_allocator import BlockAllocator
from mlafx.runtime.request import Request
from mlafx.runtime.sampler import sample
from mlafx.runtime.sampling_params import (
    CompletionOutput,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
)
from mlafx.runtime.scheduler import Scheduler, blocks_for_lifetime
from mlafx.runtime.step_inputs import step_inputs_for
from mlafx.runtime.tokenizer import load_tokenizer

log = logging.getLogger(__name__)

DEFAULT_KV_CACHE_MEMORY = 1 << 30  # bytes, when neither num_kv_blocks nor kv_cache_memory is given
Prompt = str | Sequence[int]


class LLM:
    """Offline inference over a paged latent KV cache.

    ``model`` is a preset name (``"deepseek-v2-lite"``) or a local directory with
    ``config.json`` and safetensors weights (``load_format="auto"``); ``"dummy"`` fills
    seeded random weights. ``hf_overrides`` is applied over config.json before validation.
    ``compile=True`` (the default) serves the captured, MLA-lowered, AOTInductor-compiled
    step (compiled once per config and cached on disk); ``compile=False`` runs the plain
    reference model eagerly.
    """

    def __init__(
        self,
        model: str | Path,
        *,
        load_format: LoadFormat = "auto",
        hf_overrides: dict[str, Any] | None = None,
        dtype: str = "bfloat16",
        block_size: int = 16,
        max_model_len: int | None = None,
        num_kv_blocks: int | None = None,
        kv_cache_memory: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        seed: int = 0,
        progress: bool = True,
        compile: bool = True,
        compile_cache_dir: str | Path | None = None,
    ) -> None:
        self.config = cfg = ModelConfig.from_model(model, hf_overrides)
        self.dtype = torch_dtype(dtype)
        if not 1 <= block_size <= 256:
            raise ValueError(f"block_size must be in 1..256, got {block_size}")
        if max_model_len is None:
            max_model_len = cfg.max_position_embeddings
        if not 2 <= max_model_len <= cfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len must be in 2..{cfg.max_position_embeddings} "
                f"(max_position_embeddings), got {max_model_len}"
            )
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if load_format == "auto" and isinstance(model, str) and model in PRESETS:
            raise ValueError(
                f"preset {model!r} has no weights on this machine; use load_format='dummy' "
                "or a local checkpoint directory"
            )
        num_blocks = self._num_blocks(cfg, dtype, block_size, num_kv_blocks, kv_cache_memory)
        check_fits_in_memory(cfg, dtype, num_blocks * block_size)  # before any allocation

        self.block_size = block_size
        self.max_model_len = max_model_len
        self.seed = seed
        self.model = build_model(
            cfg,
            dtype,
            load_format,
            None if model in PRESETS else model,
            seed=seed,
            progress=progress,
        )
        self.tokenizer = None if model in PRESETS else load_tokenizer(model)
        # The step the engine runs: the plain reference model, or the same model captured,
        # rewritten onto the latent-cache kernels and compiled ahead of time (AOTInductor).
        self.compiled = None
        self.step_fn: Callable[..., torch.Tensor] = self.model
        if compile:
            from mlafx.export.compiled_step import compile_step

            cache_dir = None if compile_cache_dir is None else Path(compile_cache_dir)
            self.compiled = compile_step(self.model, block_size, cache_dir=cache_dir)
            self.step_fn = self.compiled
        # One cache tensor per layer: [num_blocks, block_size, Lkv + R], no head axis.
        self.kv_caches = [
            torch.zeros(num_blocks, block_size, cfg.latent_width, dtype=self.dtype)
            for _ in range(cfg.num_hidden_layers)
        ]
        self.allocator = BlockAllocator(num_blocks)
        self.scheduler = Scheduler(
            self.allocator,
            block_size=block_size,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
        )
        self._request_counter = itertools.count()
        log.info(
            "mlafx engine: %s (%d layers) %s, %d KV blocks of %d tokens",
            cfg.model_type,
            cfg.num_hidden_layers,
            dtype,
            num_blocks,
            block_size,
        )

    @staticmethod
    def _num_blocks(
        cfg: ModelConfig,
        dtype: str,
        block_size: int,
        num_kv_blocks: int | None,
        kv_cache_memory: int | None,
    ) -> int:
        if num_kv_blocks is not None and kv_cache_memory is not None:
            raise ValueError("give num_kv_blocks or kv_cache_memory, not both")
        if num_kv_blocks is not None:
            blocks = num_kv_blocks
        else:
            memory = DEFAULT_KV_CACHE_MEMORY if kv_cache_memory is None else kv_cache_memory
            blocks = memory // (kv_bytes_per_token(cfg, dtype) * block_size)
        if blocks < 2:
            raise ValueError(
                f"the KV cache holds {blocks} block(s) of {block_size} tokens; at least 2 are "
                "needed (block 0 is reserved): raise num_kv_blocks or kv_cache_memory"
            )
        return int(blocks)

    # ----- public API -----
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Serve every prompt to completion; outputs come back in prompt order."""
        prompt_list = self._as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(prompt_list)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != len(prompt_list):
            raise ValueError(f"{len(params)} sampling params for {len(prompt_list)} prompts")
        # Validate everything before queueing anything: a bad prompt leaves the engine idle.
        requests = [
            self._make_request(p, sp, i)
            for i, (p, sp) in enumerate(zip(prompt_list, params, strict=True))
        ]
        for request in requests:
            self.scheduler.add(request)
        try:
            while self.scheduler.has_unfinished():
                self.step()
        finally:
            self.scheduler.abort_all()  # a no-op after success; frees the cache after an error
        return [self._output(r) for r in requests]

    # ----- one engine step -----
    def step(self) -> None:
        batch = self.scheduler.schedule()
        if not batch:
            raise RuntimeError("scheduler made no progress (KV cache exhausted)")
        inputs = step_inputs_for(batch, self.block_size)
        with torch.inference_mode():
            logits = self.step_fn(
                inputs.input_ids,
                inputs.positions,
                self.kv_caches,
                inputs.meta,
                inputs.logits_indices,
            )
        now = time.perf_counter()
        for seq, drawn in zip(batch, sample(logits, [s.request for s in batch]), strict=True):
            request = seq.request
            request.num_computed_tokens = seq.end
            request.output_token_ids.append(drawn.token_id)
            request.cumulative_logprob += drawn.logprob
            if drawn.top_logprobs is not None:
                request.output_logprobs.append(drawn.top_logprobs)
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            request.finish_reason = self._finish_reason(request, drawn.token_id)
            if request.finished:
                request.metrics.finished_time = now
                self.scheduler.finish(request)

    def _finish_reason(self, request: Request, token: int) -> str | None:
        params = request.params
        if token in params.stop_token_ids or (
            not params.ignore_eos and token in self.config.eos_token_ids
        ):
            return "stop"
        if (
            len(request.output_token_ids) >= params.max_tokens
            or request.num_tokens >= self.max_model_len
        ):
            return "length"
        return None

    # ----- requests in and out -----
    def _as_prompt_list(self, prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
        if isinstance(prompts, str):
            return [prompts]
        prompts = list(prompts)
        if prompts and all(isinstance(t, int) for t in prompts):
            return [prompts]  # a single prompt of token ids
        return prompts

    def _make_request(self, prompt: Prompt, params: SamplingParams, index: int) -> Request:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params for prompt {index} must be SamplingParams")
        text = None
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    f"prompt {index} is text but the model has no tokenizer.json; pass token ids"
                )
            text, prompt = prompt, self.tokenizer.encode(prompt).ids
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError(f"prompt {index} is empty")
        vocab = self.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(
                f"prompt {index} has token id(s) outside the vocabulary [0, {vocab}): {bad[:5]}"
            )
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt {index} has {len(ids)} tokens; max_model_len={self.max_model_len} leaves "
                "no room to generate"
            )
        needed = blocks_for_lifetime(
            len(ids), params.max_tokens, self.max_model_len, self.block_size
        )
        if needed > self.allocator.num_usable_blocks:
            raise ValueError(
                f"prompt {index} needs {needed} KV blocks ({len(ids)} prompt + {params.max_tokens} "
                f"new tokens) but the cache has only {self.allocator.num_usable_blocks}: raise "
                "num_kv_blocks / kv_cache_memory or lower max_tokens"
            )
        request_id = str(next(self._request_counter))
        generator = None
        if params.temperature > 0:
            seed = (
                params.seed if params.seed is not None else self.seed * 1_000_003 + int(request_id)
            )
            generator = torch.Generator().manual_seed(seed)
        return Request(
            request_id=request_id,
            prompt_token_ids=ids,
            params=params,
            metrics=RequestMetrics(arrival_time=time.perf_counter()),
            prompt_text=text,
            generator=generator,
        )

    def _output(self, request: Request) -> RequestOutput:
        text = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(request.output_token_ids)
        completion = CompletionOutput(
            index=0,
            token_ids=list(request.output_token_ids),
            text=text,
            finish_reason=request.finish_reason,
            logprobs=list(request.output_logprobs) if request.params.logprobs is not None else None,
            cumulative_logprob=request.cumulative_logprob,
        )
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            outputs=[completion],
            finished=request.finished,
            prompt=request.prompt_text,
            num_cached_tokens=0,
            metrics=request.metrics,
        )
