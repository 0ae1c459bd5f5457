"""Ahead-of-time artifacts (AOTInductor package, ``torch.export`` .pt2, ONNX).

Filled by the export issue. Must not import ``mlafx.runtime``.
"""
