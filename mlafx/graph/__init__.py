"""Capture: the step function as an FX graph (``torch.export``), with shape metadata.

Filled by the compiler issue; the reference model in ``mlafx.models`` is written so
that it exports with dynamic shapes (no ``.item()``, no Python loop over sequences,
no boolean indexing, no complex dtypes).
"""
