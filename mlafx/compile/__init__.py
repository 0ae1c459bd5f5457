"""The compiler: capture -> MLA passes -> AOTInductor packages, loaded in process.

- ``compiled_step.py``: lower the step and AOT-compile it; the engine's compiled path and the
  aoti artifact run the same packages
- ``aoti_runner.py``: run an AOTInductor package without importing the compiler

Used by ``runtime/`` (``LLM(compile=True)``), ``parallel/`` (each rank's step) and ``export/``
(artifacts); imports none of them.
"""
