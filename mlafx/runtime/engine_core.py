"""The engine loop, independent of how the step was built (reference model, in-process
compiled step, or a shipped artifact).

One step: schedule -> build the step's index tensors -> run the step -> sample -> append
-> offer completed blocks to the prefix cache, save computed prompts to the KV connector,
retire finished requests.
"""

from __future__ import annotations

import logging
import time

import torch

from mlafx.config import ModelConfig, ServedConfig
from mlafx.config.deepseek_v4 import DeepseekV4Config
from mlafx.kernels import batch_invariant_mode
from mlafx.models.attention_path import split_threshold
from mlafx.models.step import StepFn
from mlafx.parallel import TensorParallelError
from mlafx.runtime.attention_costs import attention_path_costs
from mlafx.runtime.block_manager import BlockManager
from mlafx.runtime.kv_connector.base import KVConnector
from mlafx.runtime.kv_transfer import KVTransfer
from mlafx.runtime.metrics import EngineStats
from mlafx.runtime.request import Request
from mlafx.runtime.sampler import Sample, SamplingError, sample, top_logprobs
from mlafx.runtime.scheduler import ScheduledSequence, Scheduler
from mlafx.runtime.step_inputs import step_inputs_for
from mlafx.runtime.step_slowdown import StepSlowdownMonitor
from mlafx.runtime.token_rows import TokenRowBlocks

log = logging.getLogger(__name__)
_LOGPROB_ROWS = 256  # prompt-logprob rows turned into float32 log-softmax at a time


class EngineCore:
    """Owns the paged latent cache, the block manager and the scheduler; runs steps."""

    def __init__(
        self,
        config: ServedConfig,
        step_fn: StepFn,
        *,
        dtype: torch.dtype,
        block_size: int,
        num_blocks: int,
        max_model_len: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
        enable_prefix_caching: bool = True,
        kv_connector: KVConnector | None = None,
        partial_block_hits: bool = True,
        batch_invariant: bool = False,
        num_token_blocks: int | None = None,
    ) -> None:
        """``partial_block_hits``: reuse the leading rows of a cached block by copying them
        (``Scheduler``); off when the step keeps its own caches (tensor-parallel workers),
        where these tensors are not the ones the step reads. ``batch_invariant``: every
        sequence takes the absorbed attention path (one arithmetic for a token however it is
        scheduled) and each step runs the kernels in batch-invariant mode.
        ``num_token_blocks``: DeepSeek-V4's token caches get that many blocks of their own, a
        sequence holding only those it still reads (``token_rows.py``; the step must take
        ``bind_token_blocks``); None: every cache has ``num_blocks``."""
        self.config = config
        self.batch_invariant = batch_invariant
        # None: no cost rule, every span absorbed (models/step.py)
        self.split_threshold = (
            None
            if batch_invariant or not isinstance(config, ModelConfig)  # V4: one path
            else split_threshold(config, attention_path_costs(config, dtype))
        )
        self.step_fn = step_fn
        # only a step that reads them gets the key rows (one per cached token of the batch)
        self.key_rows = step_fn.reads_key_rows
        self.block_size = block_size
        self.max_model_len = max_model_len
        # The paged caches, [num_blocks, rows, width] each with no head axis
        # (``cache_block_shapes``): an MLA model's hold ``block_size`` token rows (a latent
        # cache per MLA block, a DSA indexer's keys); DeepSeek-V4's pools hold one entry per
        # ``compress_rate`` tokens. All share the block ids and block tables, but for V4's
        # token caches in blocks of their own (``num_token_blocks``).
        shapes = config.cache_block_shapes(block_size)
        self.blocks = BlockManager(num_blocks, enable_prefix_caching=enable_prefix_caching)
        self.token_rows: TokenRowBlocks | None = None
        self.token_caches: tuple[bool, ...] = (False,) * len(shapes)
        first_read = None
        if num_token_blocks is not None:
            assert isinstance(config, DeepseekV4Config)  # only V4 keeps token rows apart
            self.token_rows = TokenRowBlocks(num_token_blocks, num_blocks, self.blocks.is_cached)
            self.token_caches, first_read = config.token_caches(), config.first_token_row_read
            self.blocks.on_reuse = self.token_rows.forget
            self.blocks.replaces = self.token_rows.replaces
            step_fn.bind_token_blocks(self.token_rows.table)  # type: ignore[attr-defined]
        self.kv_caches = [
            torch.zeros(
                num_token_blocks if token and num_token_blocks else num_blocks,
                rows,
                width,
                dtype=dtype,
            )  # fmt: skip
            for (rows, width), token in zip(shapes, self.token_caches, strict=True)
        ]
        self.stats = EngineStats()
        # under TP the driver's threads wait for the workers': its step time covers theirs
        self.slowdown = StepSlowdownMonitor(threads=torch.get_num_threads)
        self.kv_transfer = (
            None
            if kv_connector is None
            else KVTransfer(kv_connector, self.kv_caches, self.token_rows, self.token_caches)
        )
        self.scheduler = Scheduler(
            self.blocks,
            self.stats,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_chunked_prefill=enable_chunked_prefill,
            kv_transfer=self.kv_transfer,
            copy_rows=self._copy_rows if partial_block_hits else None,
            token_rows=self.token_rows,
            first_read=first_read,
        )
        self.requests: dict[str, Request] = {}  # unfinished, by id

    def _copy_rows(self, src: int, dst: int, rows: int) -> None:
        """The cache rows of tokens ``0 .. rows-1`` of block ``src`` into block ``dst``, every
        cache: a pool of ``per_block`` entries per block copies the entries those tokens
        closed (``rows * per_block // block_size``: entry ``j`` closes at token
        ``(j + 1) * rate - 1`` of the block); token caches in blocks of their own copy between
        the blocks holding ``src``'s and ``dst``'s token rows."""
        for cache, token in zip(self.kv_caches, self.token_caches, strict=True):
            count = rows * cache.shape[1] // self.block_size
            if token and self.token_rows is not None:
                rows_of = self.token_rows.token_block
                cache[rows_of(dst), :count] = cache[rows_of(src), :count]
            else:
                cache[dst, :count] = cache[src, :count]

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already being served")
        self.requests[request.request_id] = request
        self.scheduler.add(request)

    def abort(self, request_id: str) -> Request | None:
        """Stop serving a request and free its blocks; None if it is unknown or done."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self.scheduler.abort(request)
        request.finish_reason = "abort"
        request.metrics.finished_time = time.perf_counter()
        self.stats.num_aborted_requests += 1
        return request

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[Request]:
        """One forward step; returns the requests that drew a token or ended in it.

        A step that raises is retried one sequence at a time; a sequence that fails alone
        (or whose logits cannot be sampled) fails its request only (finish reason
        ``"error"``, ``Request.error`` says why): no request sees another's failure."""
        if not self.requests:
            return []
        started = time.perf_counter()
        batch = self.scheduler.schedule()
        if not batch:
            raise RuntimeError("scheduler made no progress (KV cache exhausted)")
        changed: list[Request] = []
        try:
            parts = [(batch, self._forward(batch))]
        except TensorParallelError:
            raise  # the worker group is gone: no request can be served
        except Exception as e:
            if len(batch) == 1:
                parts = []
                self._fail(batch[0].request, e)
                changed.append(batch[0].request)
            else:
                log.warning("step of %d sequences failed (%s); retrying each alone", len(batch), e)
                parts = []
                for seq in batch:
                    try:
                        parts.append(([seq], self._forward([seq])))
                    except Exception as alone:
                        self._fail(seq.request, alone)
                        changed.append(seq.request)
        for part, logits in parts:
            changed += self._finish_part(part, logits)
        elapsed = time.perf_counter() - started
        self.stats.num_steps += 1
        self.stats.busy_seconds += elapsed
        self.slowdown.record(sum(seq.num_tokens for seq in batch), len(batch), elapsed)
        return changed

    def _forward(self, batch: list[ScheduledSequence]) -> torch.Tensor:
        inputs = step_inputs_for(
            batch, self.block_size, self.split_threshold, key_rows=self.key_rows
        )
        # the kernels' mode is process-wide: set for this step only (another engine may differ)
        with torch.inference_mode(), batch_invariant_mode(self.batch_invariant):
            return self.step_fn(
                inputs.input_ids,
                inputs.positions,
                self.kv_caches,
                inputs.meta,
                inputs.logits_indices,
            )

    def _finish_part(self, batch: list[ScheduledSequence], logits: torch.Tensor) -> list[Request]:
        """After a (sub-)batch ran: prompt logprobs, cache bookkeeping, then the draws."""
        sampling: list[Request] = []
        rows: list[int] = []  # each sampling request's logits row
        row = 0
        for seq in batch:
            request = seq.request
            all_logits = seq.all_logits  # before the logprobs below complete it
            num_rows = (seq.end - seq.start) if all_logits else int(seq.samples)
            if all_logits:
                self._prompt_logprobs(request, seq.start, logits[row : row + num_rows])
            row += num_rows
            request.num_computed_tokens = seq.end
            self.stats.computed_prompt_tokens += max(
                min(seq.end, request.num_prompt_tokens) - seq.start, 0
            )
            self.scheduler.register_computed_blocks(request)
            self.scheduler.save_prompt(request)
            if seq.samples:
                sampling.append(request)
                rows.append(row - 1)
        drawing = [r for r in sampling if r.params.max_tokens > 0]
        draw_rows = [i for r, i in zip(sampling, rows, strict=True) if r.params.max_tokens > 0]
        drawn = sample(logits[draw_rows], drawing, self.config.eos_token_ids)
        now = time.perf_counter()
        for request in sampling:
            if request.params.max_tokens == 0:  # the prompt only
                self._retire(request, "length", now)
        for request, choice in zip(drawing, drawn, strict=True):
            if isinstance(choice, SamplingError):
                self._fail(request, choice)
            else:
                self._append(request, choice, now)
        return sampling

    def _prompt_logprobs(self, request: Request, start: int, logits: torch.Tensor) -> None:
        """Append the logprobs of prompt tokens ``start+1 ..`` from the logits rows of
        positions ``start ..`` (row i predicts token ``start + i + 1``); tokens already
        scored (a prompt recomputed after a preemption) are skipped."""
        k = request.params.prompt_logprobs
        assert request.prompt_logprobs is not None and k is not None
        skip = max(len(request.prompt_logprobs) - (start + 1), 0)
        logits = logits[skip:]
        start += skip
        targets = request.prompt_token_ids[start + 1 : start + 1 + logits.shape[0]]
        for first in range(0, len(targets), _LOGPROB_ROWS):
            chunk = torch.log_softmax(logits[first : first + _LOGPROB_ROWS].float(), dim=-1)
            for i, token in enumerate(targets[first : first + _LOGPROB_ROWS]):
                entry = top_logprobs(chunk[i], k)
                entry[token] = chunk[i, token].item()
                request.prompt_logprobs.append(entry)

    def _fail(self, request: Request, error: Exception) -> None:
        """End ``request`` with finish reason "error" (its blocks freed, unregistered)."""
        log.error("request %s failed: %s: %s", request.request_id, type(error).__name__, error)
        request.error = f"{type(error).__name__}: {error}"
        self._retire(request, "error", time.perf_counter())

    def _retire(self, request: Request, reason: str, now: float) -> None:
        request.finish_reason = reason
        request.metrics.finished_time = now
        self.scheduler.finish(request)
        del self.requests[request.request_id]
        self.stats.num_finished_requests += 1

    def _append(self, request: Request, choice: Sample, now: float) -> None:
        request.output_token_ids.append(choice.token_id)
        request.cumulative_logprob += choice.logprob
        if choice.top_logprobs is not None:
            request.output_logprobs.append(choice.top_logprobs)
        metrics = request.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.last_token_time = now
        metrics.num_output_tokens += 1
        self.stats.generation_tokens += 1
        reason = self._finish_reason(request, choice.token_id)
        if reason is not None:
            self._retire(request, reason, now)

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

    def metrics(self) -> dict[str, float]:
        return {
            **self.stats.as_dict(self.blocks.num_free_blocks, self.blocks.num_usable_blocks),
            "token_rows_usage": (
                0.0
                if self.token_rows is None
                else self.token_rows.num_held / (self.token_rows.num_blocks - 1)
            ),
            "num_slow_steps": self.slowdown.num_slow_steps,
            "last_step_vs_median": self.slowdown.last_ratio,
        }

    def close(self) -> None:
        if self.kv_transfer is not None:
            self.kv_transfer.close()
