"""The ``onnx`` format: the functional step as an ONNX model that stock onnxruntime runs.

Export: lowered step -> functional step (cache writes become outputs, checked against the
in-place step) -> ``torch.export`` -> ``torch.onnx.export`` with the mlafx ops translated
to standard ONNX ops (``onnx_ops.py``) -> ``onnx.checker``. The model's initializers are
not copied: they are ONNX external data pointing into the artifact's safetensors file
(whose layout is header, then each tensor's raw little-endian bytes), so one weights file
serves every format. Initializers the exporter made itself (folded constants) are stored
inline.

Run (:class:`OnnxStep`): the step ABI around an ORT session; each call feeds the step's
inputs, gets ``logits`` and one ``[T, Lkv+R]`` row block per layer, and writes the rows
into the host's paged cache before returning the logits.

Only float32 is exported: onnxruntime's CPU provider has no bfloat16 kernels for most of
the step's ops.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, cast

import torch
from torch.utils import _pytree as pytree

from mlafx.compile.compiled_step import LoweredGraph
from mlafx.export.functional_step import check, make_functional, write_rows
from mlafx.graph.capture import sample_step, size_oblivious, step_dynamic_shapes
from mlafx.models.deepseek import MLAForCausalLM
from mlafx.models.safetensors_file import StoredTensor, tensor_locations
from mlafx.passes.derived_constants import source_of

log = logging.getLogger(__name__)
ONNX_FILE = "step.onnx"
_SAFETENSORS_DTYPE = {"F32": 1, "I32": 6, "I64": 7, "F16": 10, "BF16": 16}  # onnx elem types


def export_onnx(
    lowered: LoweredGraph, model: MLAForCausalLM, block_size: int, directory: Path, weights: str
) -> dict[str, Any]:
    """Write ``directory/step.onnx`` (weights referenced in ``directory/weights``); returns
    the manifest's ``step`` facts."""
    import onnx

    from mlafx.export.onnx_ops import OPSET, translation_table

    sample, caches = sample_step(model, block_size)
    if caches[0].dtype != torch.float32:
        raise ValueError(
            f"ONNX export needs dtype float32 (got {caches[0].dtype}): onnxruntime's CPU "
            "provider lacks bfloat16/float16 kernels for the step's ops"
        )
    functional = make_functional(lowered.lowering.graph)
    plain_linears(functional)
    report = check(lowered.lowering.graph, functional, sample, caches)
    log.warning(
        "onnx: functional step matches the in-place step (logits within %.2g)",
        report.max_abs_output_diff,
    )
    num_layers = len(caches)
    with size_oblivious(), torch.no_grad():
        program = torch.export.export(
            functional,
            lowered.sample_args,
            dynamic_shapes=step_dynamic_shapes(num_layers),
            strict=False,
        )
    log.warning("onnx: translating the step to ONNX opset %d", OPSET)
    onnx_program = torch.onnx.export(
        program,
        dynamo=True,
        custom_translation_table=cast(Any, translation_table()),
        opset_version=OPSET,
        optimize=False,  # folding would copy derived weights (W_UK views...) into the model
        verbose=False,
    )
    assert onnx_program is not None  # torch.onnx.export returns the program with dynamo=True
    tmp = directory / "step.tmp.onnx"
    onnx_program.save(str(tmp), external_data=True)
    proto = onnx.load(str(tmp), load_external_data=False)
    for node in proto.graph.node:  # the exporter's per-node FX dump and stack traces
        del node.metadata_props[:]
    referenced, inline = _point_initializers_at(proto, tmp, directory / weights, weights)
    for leftover in (tmp, directory / f"{tmp.name}.data"):
        leftover.unlink(missing_ok=True)
    onnx.save(proto, str(directory / ONNX_FILE))
    onnx.checker.check_model(str(directory / ONNX_FILE), full_check=True)
    log.warning(
        "onnx: %d initializers read from %s, %d inline; onnx.checker passed",
        referenced,
        weights,
        inline,
    )
    return {
        "file": ONNX_FILE,
        "opset": OPSET,
        "input_names": [spec.arg.name for spec in program.graph_signature.input_specs
                        if spec.kind == torch.export.graph_signature.InputKind.USER_INPUT],
        "outputs": ["logits"] + [f"rows_{i}" for i in range(num_layers)],
    }  # fmt: skip


def plain_linears(gm: torch.fx.GraphModule) -> int:
    """ONNX has no packed weight layout. Pattern -> replacement:
    ``mlafx.linear_packed(x, W_packed, N, b)`` -> ``aten.linear(x, W, b)``, with ``W`` the
    checkpoint weight ``W_packed`` was derived from (``derived_constants.source_of``), read by
    a new ``get_attr``: the lowered step no longer reads it, but it is still an attribute of
    ``gm`` (the lowered graph module keeps every weight of the captured one). The packed
    constants (derived at load time, never stored) are dropped from ``gm``, so the ONNX model
    reads only the checkpoint's weights. Returns how many linears were rewritten."""
    graph, packed_attrs, rewritten = gm.graph, set(), 0
    weights: dict[str, torch.fx.Node] = {}  # one get_attr per source weight, at its first use
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.mlafx.linear_packed.default:
            continue
        x, packed, _out_features, bias = node.args
        source = source_of(packed.target) if packed.op == "get_attr" else None
        if source is None or not _has_attr(gm, source):
            raise ValueError(
                f"plain_linears: {node.name} reads {packed}, not a packed weight of the graph "
                "whose source weight is still an attribute of it"
            )
        with graph.inserting_before(node):
            if source not in weights:
                weights[source] = graph.get_attr(source)  # [N, K]
            linear = graph.call_function(torch.ops.aten.linear.default, (x, weights[source], bias))
        linear.meta = dict(node.meta)
        node.replace_all_uses_with(linear)
        graph.erase_node(node)
        if not packed.users:
            packed_attrs.add(packed.target)
            graph.erase_node(packed)
        rewritten += 1
    for target in packed_attrs:
        owner_path, _, attr = target.rpartition(".")
        owner = gm.get_submodule(owner_path) if owner_path else gm
        delattr(owner, attr)
    graph.lint()
    gm.recompile()
    return rewritten


def _has_attr(gm: torch.fx.GraphModule, target: str) -> bool:
    owner_path, _, attr = target.rpartition(".")
    try:
        owner = gm.get_submodule(owner_path) if owner_path else gm
    except AttributeError:
        return False
    return isinstance(getattr(owner, attr, None), torch.Tensor)


def _point_initializers_at(
    proto: Any, saved: Path, weights_path: Path, weights: str
) -> tuple[int, int]:
    """Re-point every external initializer at the same tensor in the safetensors file, or
    store it inline when the file has no such tensor. Returns (referenced, inline)."""
    import onnx

    stored = tensor_locations(weights_path)
    referenced = inline = 0
    for init in proto.graph.initializer:
        if init.data_location != onnx.TensorProto.EXTERNAL:
            continue
        entry = {e.key: e.value for e in init.external_data}
        target = stored.get(init.name)
        if target is not None and _same_tensor(init, target):
            del init.external_data[:]
            for key, value in (
                ("location", weights),
                ("offset", str(target.offset)),
                ("length", str(target.length)),
            ):
                init.external_data.add(key=key, value=value)
            referenced += 1
            continue
        with open(saved.parent / entry["location"], "rb") as f:
            f.seek(int(entry.get("offset", 0)))
            init.raw_data = f.read(int(entry["length"]))
        del init.external_data[:]
        init.data_location = onnx.TensorProto.DEFAULT
        inline += 1
    return referenced, inline


def _same_tensor(init: Any, target: StoredTensor) -> bool:
    return (
        _SAFETENSORS_DTYPE.get(target.dtype) == init.data_type and tuple(init.dims) == target.shape
    )


class OnnxStep:
    """The step ABI over an onnxruntime session of the functional step (see module doc)."""

    reads_key_rows = False  # StepFn: its attention derives the key rows from the block tables

    def __init__(self, path: Path, input_names: list[str], threads: int | None = None) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads or torch.get_num_threads()
        options.inter_op_num_threads = 1
        # onnxruntime 1.30's FusedMatMul (from MatmulTransposeFusion) dies with SIGFPE on an
        # empty batch (an empty sub-batch of the step, e.g. no absorbed rows): keep MatMul.
        self.session = ort.InferenceSession(
            str(path),
            options,
            providers=["CPUExecutionProvider"],
            disabled_optimizers=["MatmulTransposeFusion"],
        )
        self.input_names = input_names
        self.fed = {i.name for i in self.session.get_inputs()}
        unknown = self.fed - set(input_names)
        if unknown:
            raise ValueError(f"{path.name} takes inputs {sorted(unknown)} the step does not have")

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        caches: list[torch.Tensor],
        meta: Any,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        leaves = pytree.tree_leaves((input_ids, positions, caches, meta, logits_indices))
        if len(leaves) != len(self.input_names):
            raise ValueError(
                f"the step got {len(leaves)} tensors; the ONNX step takes {len(self.input_names)}"
            )
        feed = {
            name: tensor.numpy()
            for name, tensor in zip(self.input_names, leaves, strict=True)
            if name in self.fed
        }
        logits, *rows = self.session.run(None, feed)
        write_rows(caches, [torch.from_numpy(r) for r in rows], meta.slot_mapping)
        return torch.from_numpy(logits)
