"""Benchmark cases for `bench/kernels.py`, one module per op family.

Each module exposes ``run(roofline, *, quick, threads) -> list[Row]``; `kernels.py` lists the
modules explicitly (CASE_MODULES) and runs them in order.
"""
