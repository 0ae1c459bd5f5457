"""Turns a scheduled batch into the step's input tensors (the step ABI of DESIGN.md)."""

from __future__ import annotations

from mlafx.models.step import SequenceSpan, StepInputs, build_step_inputs
from mlafx.runtime.scheduler import ScheduledSequence


def step_inputs_for(
    batch: list[ScheduledSequence],
    block_size: int,
    split_threshold: float | None = None,
    *,
    key_rows: bool = True,
) -> StepInputs:
    """``split_threshold``: the attention-path cost rule's (``models/attention_path.py``):
    spans with more new tokens take the split; ``key_rows``: the step reads them
    (``StepFn.reads_key_rows``; see ``build_step_inputs``)."""
    spans = [
        SequenceSpan(
            s.request.token_ids(s.start, s.end),
            s.start,
            s.end,
            s.request.blocks,
            sample=s.samples,
            all_logits=s.all_logits,
        )
        for s in batch
    ]
    return build_step_inputs(spans, block_size, split_threshold, key_rows=key_rows)
