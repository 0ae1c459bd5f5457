"""The ``pt2`` format: the lowered step as a ``torch.export`` program, weights as inputs.

``step.pt2`` (``torch.export.save``) holds the graph and small traced constants only; the
program takes the weights as its first argument, a dict keyed by FQN that the loader fills
from the artifact's safetensors file, so the weights are stored once for every format.
It runs as the exported graph module (``ExportedProgram.module()``): no compilation, any
CPU (the mlafx kernels pick AVX-512 or their portable path at run time).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mlafx.compile.compiled_step import LoweredGraph
from mlafx.graph.capture import size_oblivious, step_dynamic_shapes
from mlafx.passes.derived_constants import with_derived_constants

PT2_FILE = "step.pt2"


class _StepWithWeights(torch.nn.Module):
    """``step(weights, *step_args)``: the lowered graph called with ``weights`` as its
    parameters and buffers. The graph is held in a tuple so that export does not lift its
    own tensors as the program's state."""

    def __init__(self, step: torch.fx.GraphModule) -> None:
        super().__init__()
        self._step = (step,)

    def forward(self, weights, input_ids, positions, caches, meta, logits_indices):  # type: ignore[no-untyped-def]
        args = (input_ids, positions, caches, meta, logits_indices)
        return torch.func.functional_call(self._step[0], weights, args, strict=True)


def step_weight_names(step: torch.fx.GraphModule) -> list[str]:
    """The parameters and buffers the lowered graph reads, by FQN."""
    names = [n for n, _ in step.named_parameters(remove_duplicate=False)]
    return names + [n for n, _ in step.named_buffers(remove_duplicate=False)]


def export_pt2(lowered: LoweredGraph, directory: Path) -> dict[str, Any]:
    """Write ``directory/step.pt2``; returns the manifest's ``step`` facts."""
    step = lowered.lowering.graph
    state: dict[str, torch.Tensor] = dict(step.named_parameters(remove_duplicate=False))
    state.update(step.named_buffers(remove_duplicate=False))
    dynamic = step_dynamic_shapes(len(lowered.sample_args[2]))
    with size_oblivious(), torch.no_grad():
        program = torch.export.export(
            _StepWithWeights(step),
            (state, *lowered.sample_args),
            dynamic_shapes={"weights": {name: None for name in state}, **dynamic},
            strict=False,
        )
    if program.state_dict:
        raise RuntimeError(
            f"pt2 export kept weights in the program: {list(program.state_dict)[:5]}"
        )
    # the example inputs would be pickled into the archive, weights included: drop them
    program.example_inputs = None
    torch.export.save(program, directory / PT2_FILE)
    return {"file": PT2_FILE, "weight_names": list(state)}  # the order the program takes


class Pt2Step:
    """The step ABI over a loaded ``step.pt2`` and its weights."""

    reads_key_rows = False  # StepFn: the lowered graph reads the per-sequence fields

    def __init__(self, path: Path, weights: dict[str, torch.Tensor], names: list[str]) -> None:
        weights = with_derived_constants(weights, names)  # derived at load time, never stored
        missing = sorted(set(names) - set(weights))
        if missing:
            raise ValueError(f"{path.name} needs weights the artifact lacks: {missing[:5]}")
        self.module = torch.export.load(path).module()
        # The host builds the inputs to the step ABI. torch's own input check refuses a
        # size 0 for an extent exported as ``s + 1`` (an empty sub-batch's cu_seqlens).
        setattr(self.module, "validate_inputs", False)  # noqa: B010  (not a declared attribute)
        self.weights = {name: weights[name] for name in names}

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        caches: list[torch.Tensor],
        meta: Any,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        return self.module(self.weights, input_ids, positions, caches, meta, logits_indices)
