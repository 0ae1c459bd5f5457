"""Run an AOTInductor package without importing ``torch._inductor``.

``torch._inductor.aoti_load_package`` imports the whole inductor compiler (~2.4 s here)
just to wrap the C++ package loader, which itself takes milliseconds: most of an artifact's
cold start. :class:`PackageRunner` wraps the same loader with the same calling convention
as torch's ``AOTICompiledModel`` (pytree-flattened tensor inputs, ``boxed_run``, outputs
unflattened with the package's out spec). The loader is torch's private
``torch._C._aoti.AOTIModelPackageLoader``; artifacts pin the torch version, so its
signature is the one of the torch that compiled the package.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

MODEL_NAME = "model"  # aoti_compile_and_package's default name inside the archive


class PackageRunner:
    """A loaded AOTInductor package: call it like the exported module."""

    def __init__(self, package: Path) -> None:
        self.loader = torch._C._aoti.AOTIModelPackageLoader(str(package), MODEL_NAME, False, 1, -1)
        _, out_spec = self.loader.get_call_spec()
        self.out_spec = pytree.treespec_loads(out_spec)

    def __call__(self, *args: Any) -> Any:
        flat = [x for x in pytree.tree_leaves(args) if isinstance(x, torch.Tensor)]
        return pytree.tree_unflatten(self.loader.boxed_run(flat), self.out_spec)

    def run_flat(self, flat: list[torch.Tensor]) -> list[torch.Tensor]:
        """The package's outputs, flat, for its inputs already flattened (in pytree leaf
        order): what a caller that runs it many times a step uses (``boxed_run`` takes
        the list)."""
        return self.loader.boxed_run(flat)

    def get_constant_fqns(self) -> list[str]:
        return self.loader.get_constant_fqns()

    def load_constants(
        self, constants: dict[str, torch.Tensor], *, check_full_update: bool, user_managed: bool
    ) -> None:
        """Hand the package its weights; ``user_managed``: it keeps pointers to ours."""
        self.loader.load_constants(constants, False, check_full_update, user_managed, False)
