"""Ahead-of-time artifacts (AOTInductor package, ``torch.export`` .pt2, ONNX).

- ``artifact.py``: write an artifact directory, verify and load one
- ``manifest.py``: manifest.json and the checks run before anything is loaded
- ``weights.py``, ``isa.py``: the weights file; the CPU flags compiled code needs
- ``pt2_step.py``: the ``torch.export`` format (weights as inputs)
- ``functional_step.py``, ``onnx_ops.py``, ``onnx_export.py``: the ONNX format

``mlafx.export(model, output, format)`` is this package called as a function (it forwards
to :func:`mlafx.export.artifact.export`): the package keeps its submodules importable as
``mlafx.export.<module>`` while ``mlafx.export(...)`` writes an artifact. Nothing heavy is
imported until it is called. The compiled step itself lives in ``mlafx.compile``. Must not import
``mlafx.runtime``.
"""

from __future__ import annotations

import sys
import types
from typing import Any


class _ExportPackage(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from mlafx.export.artifact import export

        return export(*args, **kwargs)


sys.modules[__name__].__class__ = _ExportPackage
