"""``torch.library`` custom ops for MLA inference on CPU (namespace ``torch.ops.mlafx``).

Importing this package loads the C++ extension ``mlafx._C`` (failing loudly with a rebuild
hint if it is missing or stale) and registers the ops' fake implementations.

- ``extension.py``: loading, build checks, ``library_path()``, ``cpu_isa()``
- ``ops.py``: typed wrappers and fakes; the schemas live in ``csrc/<family>.cpp``
- ``reference.py``: slow Python references the tests compare against
- ``csrc/``: C++ kernels (``*_avx512.cpp`` compiled with AVX-512 flags, chosen at run time)
"""

from mlafx.kernels.extension import (
    ExtensionLoadError,
    cpu_isa,
    library_path,
    load_extension,
    parallel_num_threads,
)
from mlafx.kernels.ops import write_latent_cache

__all__ = [
    "ExtensionLoadError",
    "cpu_isa",
    "library_path",
    "load_extension",
    "parallel_num_threads",
    "write_latent_cache",
]
