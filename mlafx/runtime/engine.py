"""`LLM`: the offline engine. Loads a model, owns the paged latent cache, and serves
prompts with continuous batching, chunked prefill, prefix caching and, optionally, a KV
connector that shares computed prefixes between engines (see ``scheduler``).

``LLM.__init__`` serves a ``StepSource`` (``runtime/step_source.py``: a preset or checkpoint
built here, or what ``from_artifact`` / ``from_transformers`` build) with a ``ServingOptions``;
everything after that (cache, scheduler, the engine loop) is ``EngineCore``, started by
``_start``.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import torch

from mlafx.config import ModelConfig, ServedConfig, check_fits_in_memory
from mlafx.config.deepseek_v4 import DeepseekV4Config
from mlafx.models.loader import torch_dtype
from mlafx.models.step import StepFn
from mlafx.parallel import WorkerGroup
from mlafx.runtime.block_hash import cache_fingerprint
from mlafx.runtime.block_manager import BlockManager
from mlafx.runtime.chat_template import ChatTemplate
from mlafx.runtime.deepseek_v4_source import (
    check_deepseek_v4_options,
    deepseek_v4_source,
    is_deepseek_v4,
)
from mlafx.runtime.engine_core import EngineCore
from mlafx.runtime.kv_connector.base import KVConnector
from mlafx.runtime.options import ServingOptions
from mlafx.runtime.request import Request
from mlafx.runtime.sampling_params import (
    MAX_SEED,
    CompletionOutput,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
)
from mlafx.runtime.scheduler import blocks_for_lifetime
from mlafx.runtime.step_source import (
    ModelOptions,
    StepSource,
    artifact_source,
    check_batch_invariant,
    check_model_options,
    model_source,
    split_options,
    transformers_source,
)
from mlafx.runtime.token_rows import (
    cache_block_counts,
    keeps_token_rows_apart,
    token_blocks_for_lifetime,
)

log = logging.getLogger(__name__)

Prompt = str | Sequence[int]


def check_model(model: str | Path, **kwargs: Any) -> ServedConfig:
    """Every check ``LLM(model, **kwargs)`` makes before it reads a weight (the config, the
    options, the memory estimate); the model's config, to check requests against before a
    build and compile that can take minutes (``mlafx run``'s prompts)."""
    build, options = split_options(kwargs)
    return _check_options(model, build, options)


def _check_options(model: str | Path, build: ModelOptions, options: ServingOptions) -> ServedConfig:
    if is_deepseek_v4(model):
        return check_deepseek_v4_options(model, build, options)
    return check_model_options(model, build, options)


def check_prompt_token_ids(prompt: Sequence[int], config: ServedConfig, index: int) -> list[int]:
    """Prompt ``index``'s token ids as ints: a ValueError if it is empty or an id is outside
    the model's vocabulary."""
    ids = [int(t) for t in prompt]
    if not ids:
        raise ValueError(f"prompt {index} is empty")
    vocab = config.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(
            f"prompt {index} has token id(s) outside the vocabulary [0, {vocab}): {bad[:5]}"
        )
    return ids


class LLM:
    """Inference over a paged latent KV cache.

    ``model`` is a preset name (``"deepseek-v2-lite"``) or a local directory with
    ``config.json`` and safetensors weights (``load_format="auto"``); ``"dummy"`` fills
    seeded random weights. ``hf_overrides`` is applied over config.json before validation.
    ``compile=True`` (the default) serves the captured, MLA-lowered, AOTInductor-compiled
    step (one package per layer kind, compiled once and cached on disk; the model keeps only
    the weights the compiled step reads); ``compile=False`` runs the plain reference model
    eagerly. A lowering that fails verification is an error; ``allow_unlowered=True`` serves
    the captured, unlowered layers instead (loudly; far slower). The serving options are
    ``ServingOptions``'s. ``quantization="int8" | "int4"`` quantizes every linear and routed
    expert stack as it loads (``models/quantized.py``; formats in
    ``mlafx.kernels.quant_format``). ``kv_connector`` is a store spec (``"disk:PATH"``,
    ``"redis://HOST:PORT"``) or a ``KVConnector`` built for this engine's
    ``cache_fingerprint`` and block size. ``batch_invariant=True``: each request's tokens and
    logprobs are bitwise the same whatever else is in the batch, however its prompt is chunked
    and whether its prefix came from the cache (``ServingOptions``; tensor-parallel ranks run
    their steps in the mode too); needs ``compile=True``, not yet with quantized weights.

    Offline: ``generate(prompts, params)``. Incremental (a server's loop):
    ``add_request`` -> ``step()`` until ``has_unfinished_requests()`` is False;
    ``abort_request`` drops one. ``get_metrics()`` reports hit rates and throughput.
    A request the engine cannot serve (its step raises alone, or its logits are not finite)
    ends with finish reason ``"error"`` and never affects the others. ``chat_template`` is
    the checkpoint's (``runtime/chat_template.py``; None without one).

    ``tensor_parallel_size=N > 1`` splits the model's heads and MLP widths over N worker
    processes (``mlafx.parallel``; each with its own cores, shard, compiled step and copy of
    the latent cache) that this process drives; ``close()`` stops them. Not with
    ``kv_connector`` (the cache rows live in the workers). ``tensor_parallel_local_ranks=L``
    starts only ranks 0..L-1 here; the others run on other machines
    (``python -m mlafx.parallel.remote``; rendezvous by ``MASTER_ADDR``/``MASTER_PORT``).
    """

    workers: WorkerGroup | None = None  # the tensor-parallel ranks, when there are any
    chat_template: ChatTemplate | None = None  # the checkpoint's (runtime/chat_template.py)

    def __init__(
        self,
        model: str | Path | StepSource,
        *,
        options: ServingOptions | None = None,
        kv_connector: str | KVConnector | None = None,
        **kwargs: Any,
    ) -> None:
        """``model``: a preset name or checkpoint, built with ``kwargs`` (``ModelOptions``'
        fields: load_format, hf_overrides, dtype, quantization, progress, compile,
        compile_cache_dir, allow_unlowered, tensor_parallel_size,
        tensor_parallel_local_ranks) and served with ``ServingOptions``' fields (block_size,
        max_model_len, num_kv_blocks, kv_cache_memory, max_num_seqs, max_num_batched_tokens,
        enable_chunked_prefill, enable_prefix_caching, seed, batch_invariant); or a built
        ``StepSource`` (what ``from_artifact`` / ``from_transformers`` make) with its
        ``options``."""
        if isinstance(model, StepSource):
            if kwargs:
                raise TypeError(
                    f"LLM(StepSource) takes its serving options as options=, not {sorted(kwargs)}"
                )
            source, options = model, options or ServingOptions()
            connector = connect_kv_store(
                kv_connector, source.config, source.dtype, options.block_size
            )
        else:
            if options is not None:
                raise TypeError("LLM(model, ...) takes the serving options as keywords")
            build, options = split_options(kwargs)
            cfg = _check_options(model, build, options)
            if build.tensor_parallel_size != 1 and kv_connector is not None:
                raise ValueError(
                    "kv_connector is not supported with tensor_parallel_size > 1 (the latent "
                    "cache rows live in the worker processes)"
                )
            # a bad store spec fails here, before the (slow) model build and compile
            connector = connect_kv_store(kv_connector, cfg, build.dtype, options.block_size)
            try:
                if isinstance(cfg, DeepseekV4Config):
                    source = deepseek_v4_source(model, cfg, build, options)
                else:
                    source = model_source(model, cfg, build, options)
            except BaseException:
                if connector is not None and connector is not kv_connector:
                    connector.close()  # we opened it
                raise
        self.model, self.compiled, self.artifact = source.model, source.compiled, source.artifact
        self.workers = source.workers
        self.chat_template = source.chat_template
        try:
            self._start(source, options, connector)
        except BaseException:
            if connector is not None and connector is not kv_connector:
                connector.close()
            if self.workers is not None:
                self.workers.close()
            raise

    @classmethod
    def from_artifact(
        cls,
        path: str | Path,
        *,
        engine: str | None = None,
        kv_connector: str | KVConnector | None = None,
        **serving: Any,
    ) -> LLM:
        """Serve an artifact written by ``mlafx.export`` (or ``mlafx export``): no model
        code and no compilation; its files are hash-checked before anything is loaded (see
        ``mlafx.export.artifact``). The config, dtype and block size come from the artifact;
        ``serving``: the other ``ServingOptions`` fields. ``engine``: None serves the format's
        own runner; ``"onnxruntime"`` runs an ONNX artifact."""
        if "block_size" in serving:
            raise TypeError("an artifact's block size is its own (compiled into it)")
        if serving.get("batch_invariant"):
            raise ValueError(
                "batch_invariant is not supported with artifacts yet (an artifact's kernels "
                "were chosen when it was exported)"
            )
        source = artifact_source(path, engine)
        assert source.artifact is not None
        options = ServingOptions(block_size=source.artifact.block_size, **serving)
        cfg = source.config
        assert isinstance(cfg, ModelConfig)  # artifacts hold MLA models
        check_fits_in_memory(
            cfg, source.dtype, options.num_blocks(cfg, source.dtype) * options.block_size
        )
        return cls(source, options=options, kv_connector=kv_connector)

    @classmethod
    def from_transformers(
        cls,
        hf_model: torch.nn.Module,
        *,
        hf_overrides: dict[str, Any] | None = None,
        kv_connector: str | KVConnector | None = None,
        compile: bool = True,
        compile_cache_dir: str | Path | None = None,
        allow_unlowered: bool = False,
        **serving: Any,
    ) -> LLM:
        """Serve a ``transformers`` MLA model object (on the CPU) in its own dtype: its
        tensors are adopted by mlafx's model, not copied (see
        ``mlafx.models.from_transformers``), then captured, lowered and compiled as usual;
        ``serving``: ``ServingOptions`` fields. No tokenizer: prompts are token ids."""
        options = ServingOptions(**serving)
        if options.batch_invariant:
            check_batch_invariant(compile)
        source = transformers_source(
            hf_model, hf_overrides, options, compile, compile_cache_dir, allow_unlowered
        )
        return cls(source, options=options, kv_connector=kv_connector)

    def _start(
        self, source: StepSource, options: ServingOptions, kv_connector: KVConnector | None
    ) -> None:
        """Everything but the model: the cache, the scheduler and the engine loop, serving
        ``source.step_fn`` (``(input_ids, positions, caches, meta, logits_indices) ->
        logits``; its ``reads_key_rows`` says whether the host builds it the key rows,
        ``StepFn``)."""
        config, dtype, step_fn = source.config, source.dtype, source.step_fn
        self.config = config
        self.dtype = torch_dtype(dtype)
        self.block_size = options.block_size
        self.max_model_len = options.resolved_max_model_len(config)
        self.seed = options.seed
        self.tokenizer = source.tokenizer
        self.step_fn: StepFn = step_fn
        self.cache_fingerprint = cache_fingerprint(config, dtype, options.block_size)
        num_blocks = options.num_blocks(config, dtype)
        num_token_blocks = None
        if keeps_token_rows_apart(config, step_fn, kv_connector):
            assert isinstance(config, DeepseekV4Config)
            save_blocks = 0 if kv_connector is None else kv_connector.chunk_blocks
            num_blocks, num_token_blocks = cache_block_counts(
                config, options, dtype, self.max_model_len, save_blocks
            )
        self.engine = EngineCore(
            config,
            step_fn,
            dtype=self.dtype,
            block_size=options.block_size,
            num_blocks=num_blocks,
            max_model_len=self.max_model_len,
            max_num_seqs=options.max_num_seqs,
            max_num_batched_tokens=options.max_num_batched_tokens,
            enable_chunked_prefill=options.enable_chunked_prefill,
            enable_prefix_caching=options.enable_prefix_caching,
            kv_connector=kv_connector,
            partial_block_hits=self.workers is None,  # workers hold their own caches
            batch_invariant=options.batch_invariant,
            num_token_blocks=num_token_blocks,
        )
        self.kv_caches = self.engine.kv_caches
        self._request_counter = itertools.count()
        self._groups: dict[str, list[Request]] = {}  # add_request's, unfinished: id -> copies
        log.info(
            "mlafx engine: %s (%d layers) %s, %d KV blocks of %d tokens%s, prefix caching %s, "
            "chunked prefill %s, KV connector %s",
            config.model_type,
            config.num_hidden_layers,
            dtype,
            num_blocks,
            options.block_size,
            "" if num_token_blocks is None else f" ({num_token_blocks} for token rows)",
            "on" if options.enable_prefix_caching else "off",
            "on" if options.enable_chunked_prefill else "off",
            type(kv_connector).__name__ if kv_connector else "none",
        )

    @property
    def block_manager(self) -> BlockManager:
        return self.engine.blocks

    # ----- offline API -----
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
        groups = [
            self._make_requests(p, sp, i)
            for i, (p, sp) in enumerate(zip(prompt_list, params, strict=True))
        ]
        requests = [r for group in groups for r in group]
        for request in requests:
            self.engine.add(request)
        try:
            while not all(r.finished for r in requests):
                self.engine.step()
        finally:  # after an error, free the cache (a no-op after success)
            for request in requests:
                if not request.finished:
                    self.engine.abort(request.request_id)
        return [self._output(group) for group in groups]

    # ----- incremental API -----
    def add_request(
        self, prompt: Prompt, params: SamplingParams | None = None, *, index: int = 0
    ) -> str:
        """Queue one prompt (text or token ids); returns its request id. With ``n`` (or
        ``best_of``) > 1 its copies are ``"{id}.{i}"`` (abortable one by one). ``index``:
        the prompt's place in the caller's batch, which error messages name."""
        group = self._make_requests(prompt, params or SamplingParams(), index)
        for request in group:
            self.engine.add(request)
        request_id = group[0].request_id.partition(".")[0]
        self._groups[request_id] = group
        return request_id

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the requests that drew a token or ended in it
        (their outputs so far, every copy; ``finished`` once every copy is done)."""
        changed = {r.request_id.partition(".")[0] for r in self.engine.step()}
        outputs = []
        for request_id in sorted(changed, key=int):
            group = self._groups.get(request_id)
            if group is None:
                continue
            outputs.append(self._output(group))
            if all(r.finished for r in group):
                del self._groups[request_id]
        return outputs

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a queued or running request (every copy; or one copy ``"{id}.{i}"``) and
        free its blocks (finish reason "abort"); None if the id is unknown or finished."""
        parent = request_id.partition(".")[0]
        group = self._groups.get(parent)
        if group is None:
            return None
        targets = [r for r in group if request_id in (parent, r.request_id)]
        if not [r for r in targets if self.engine.abort(r.request_id) is not None]:
            return None
        if all(r.finished for r in group):
            del self._groups[parent]
        return self._output(group)

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished()

    def get_metrics(self) -> dict[str, float]:
        """Cumulative engine metrics, a flat dict of numbers:

        - ``prefix_cache_hit_rate``: prompt tokens found in the local prefix cache / prompt
          tokens looked up (every admitted request's prompt, once);
        - ``external_cache_hit_rate``: prompt tokens loaded from the KV connector / prompt
          tokens looked up; ``external_hit_tokens``: the numerator;
        - ``num_preemptions``: running requests evicted (and later recomputed) for blocks;
        - ``prompt_tokens_per_s``: prompt positions computed (recomputation included) per
          second spent in ``step()``; ``generation_tokens_per_s``: tokens sampled per
          second spent in ``step()``;
        - counters behind them (``prompt_tokens``, ``prefix_cache_hit_tokens``,
          ``computed_prompt_tokens``, ``generation_tokens``, ``busy_s``, ``num_requests``,
          ``num_finished_requests``, ``num_aborted_requests``, ``num_steps``) and
          ``kv_cache_usage`` (fraction of usable blocks held by requests now);
        - ``token_rows_usage``: DeepSeek-V4's token-row blocks held by requests now, as a
          fraction of the usable ones (``runtime/token_rows.py``; 0 for other models);
        - ``num_slow_steps``: steps that took at least twice their recent median (steps of
          about the same size; a busy machine, see ``runtime/step_slowdown.py``), and
          ``last_step_vs_median``: the latest step's time over that median (0 until a size
          has 16 steps).
        """
        return self.engine.metrics()

    def close(self) -> None:
        """Release the KV connector's connections and stop the tensor-parallel workers."""
        self.engine.close()
        if self.workers is not None:
            self.workers.close()

    # ----- requests in and out -----
    def _as_prompt_list(self, prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
        if isinstance(prompts, str):
            return [prompts]
        items = list(prompts)
        if items and all(isinstance(t, int) for t in items):
            return [cast(list[int], items)]  # a single prompt of token ids
        return cast(list[Prompt], items)

    def _make_requests(self, prompt: Prompt, params: SamplingParams, index: int) -> list[Request]:
        """The engine requests of one prompt: one per copy (``params.num_copies``); the
        copies after the first wait for its prompt and read it from the prefix cache, do
        not repeat its prompt logprobs and, with a seed, draw from ``seed + i``."""
        first = self._make_request(prompt, params, index)
        copies = params.num_copies
        if copies == 1:
            return [first]
        first.request_id = f"{first.request_id}.0"
        group = [first]
        for i in range(1, copies):
            seed = None if params.seed is None else (params.seed + i) % (MAX_SEED + 1)
            copy = self._make_request(
                first.prompt_token_ids,
                replace(params, seed=seed, prompt_logprobs=None),
                index,
                request_id=f"{first.request_id.partition('.')[0]}.{i}",
            )
            copy.prompt_text, copy.after = first.prompt_text, first
            group.append(copy)
        return group

    def _make_request(
        self, prompt: Prompt, params: SamplingParams, index: int, request_id: str | None = None
    ) -> Request:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params for prompt {index} must be SamplingParams")
        text = None
        token_ids: Sequence[int]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    f"prompt {index} is text but the model has no tokenizer.json; pass token ids"
                )
            text, token_ids = prompt, self.tokenizer.encode(prompt).ids
        else:
            token_ids = prompt
        ids = check_prompt_token_ids(token_ids, self.config, index)
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt {index} has {len(ids)} tokens; max_model_len={self.max_model_len} leaves "
                "no room to generate"
            )
        # A request that cannot fit even alone would wait (or be preempted) forever.
        needed = blocks_for_lifetime(
            len(ids), max(params.max_tokens, 1), self.max_model_len, self.block_size
        )
        usable = self.block_manager.num_usable_blocks
        if needed > usable:
            raise ValueError(
                f"prompt {index} needs {needed} KV blocks ({len(ids)} prompt + {params.max_tokens} "
                f"new tokens) but the cache has only {usable}: raise num_kv_blocks / "
                "kv_cache_memory or lower max_tokens"
            )
        rows = self.engine.token_rows
        if rows is not None and not self.engine.scheduler.enable_chunked_prefill:
            held = token_blocks_for_lifetime(needed)
            if held > rows.num_blocks - 1:
                raise ValueError(
                    f"prompt {index} needs {held} token-row blocks at once ({len(ids)} prompt + "
                    f"{params.max_tokens} new tokens computed in one step without chunked "
                    f"prefill) but the cache has only {rows.num_blocks - 1}: enable chunked "
                    "prefill, raise kv_cache_memory or lower max_tokens"
                )
        number = next(self._request_counter)
        generator = None
        if not params.greedy:
            seed = params.seed if params.seed is not None else self.seed * 1_000_003 + number
            generator = torch.Generator().manual_seed(seed)
        return Request(
            request_id=request_id or str(number),
            prompt_token_ids=ids,
            params=params,
            metrics=RequestMetrics(arrival_time=time.perf_counter()),
            prompt_text=text,
            generator=generator,
            prompt_logprobs=None if params.prompt_logprobs is None else [None],
        )

    def _output(self, group: list[Request]) -> RequestOutput:
        """One prompt's output: a completion per copy; once every copy is done and
        ``best_of > n``, the ``n`` with the highest cumulative logprob."""
        first = group[0]
        completions = [self._completion(i, r) for i, r in enumerate(group)]
        finished = all(r.finished for r in group)
        if finished and len(group) > first.params.n:
            best = sorted(completions, key=lambda c: -(c.cumulative_logprob or 0.0))
            completions = [replace(c, index=i) for i, c in enumerate(best[: first.params.n])]
        return RequestOutput(
            request_id=first.request_id.partition(".")[0],
            prompt_token_ids=list(first.prompt_token_ids),
            outputs=completions,
            finished=finished,
            prompt=first.prompt_text,
            num_cached_tokens=first.num_cached_tokens,
            metrics=first.metrics,
            prompt_logprobs=None if first.prompt_logprobs is None else list(first.prompt_logprobs),
        )

    def _completion(self, index: int, request: Request) -> CompletionOutput:
        text = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(request.output_token_ids)
        return CompletionOutput(
            index=index,
            token_ids=list(request.output_token_ids),
            text=text,
            finish_reason=request.finish_reason,
            logprobs=list(request.output_logprobs) if request.params.logprobs is not None else None,
            cumulative_logprob=request.cumulative_logprob,
            error=request.error,
        )


def connect_kv_store(
    spec: str | KVConnector | None, config: ServedConfig, dtype: str, block_size: int
) -> KVConnector | None:
    """The engine's KV connector: built from a spec string, or checked to match this
    engine's cache (an incompatible store must never be loaded)."""
    if spec is None:
        return None
    fingerprint = cache_fingerprint(config, dtype, block_size)
    if isinstance(spec, str):
        from mlafx.runtime.kv_connector import make_connector

        return make_connector(spec, fingerprint, block_size)
    if not isinstance(spec, KVConnector):
        raise TypeError(f"kv_connector must be a spec string or a KVConnector, got {spec!r}")
    if spec.block_size != block_size or spec.fingerprint != fingerprint:
        raise ValueError(
            f"the KV connector was made for block size {spec.block_size} and cache fingerprint "
            f"{spec.fingerprint[:12]}..., this engine has {block_size} and {fingerprint[:12]}..."
        )
    return spec
