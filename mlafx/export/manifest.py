"""``manifest.json``: what an artifact directory holds and what it needs to run.

    format               "aoti" | "pt2" | "onnx"
    artifact_version     layout of the directory and of this file (ARTIFACT_VERSION)
    mlafx_version, torch_version   the versions that wrote it
    model_config         ModelConfig as a dict; dtype; block_size; cache_layout_version
    custom_ops           schema string of every torch.ops.mlafx op the step calls
    cpu                  required_flags (/proc/cpuinfo names; empty = portable), and for aoti
                         the package's AOTI_CPU_ISA and compile flags
    files                sha256 and size of every other file in the directory
    weight_aliases       names that share another weight's tensor (tied embeddings)
    step                 format-specific facts (file names, ONNX input/output names)

Verification (:func:`verify_artifact`) reads only this JSON file and hashes every listed
file before any of them is opened by a loader: ``layer-<k>.pt2`` (aoti) holds a shared library
that runs native code when loaded, and a ``torch.export`` archive (pt2) may hold pickled
constants. A hash mismatch, a missing file, other versions, other op schemas or a CPU
lacking the compiled instruction set are refused with :class:`ArtifactError`. The hashes
protect against corruption and tampering of the files, not against a forged manifest:
only load artifacts from a source you would run code from.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mlafx.config import LongRopeScaling, ModelConfig, YarnScaling
from mlafx.export.isa import missing_cpu_flags
from mlafx.models.step import CACHE_LAYOUT_VERSION

MANIFEST_FILE = "manifest.json"
ARTIFACT_VERSION = 1
FORMATS = ("aoti", "pt2", "onnx")


class ArtifactError(ValueError):
    """An artifact that cannot be served here; the message says why and what to do."""


@dataclass(frozen=True)
class Manifest:
    format: str
    mlafx_version: str
    torch_version: str
    model_config: dict[str, Any]
    dtype: str
    block_size: int
    custom_ops: dict[str, str]
    cpu: dict[str, Any]
    files: dict[str, dict[str, Any]]
    step: dict[str, Any]
    weight_aliases: dict[str, str] = field(default_factory=dict)
    cache_layout_version: int = CACHE_LAYOUT_VERSION
    artifact_version: int = ARTIFACT_VERSION

    def config(self) -> ModelConfig:
        return config_from_dict(self.model_config)

    def write(self, directory: Path) -> None:
        text = json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)
        (directory / MANIFEST_FILE).write_text(text + "\n")

    @classmethod
    def read(cls, directory: Path) -> Manifest:
        path = directory / MANIFEST_FILE
        if not directory.is_dir():
            raise ArtifactError(f"{directory} is not a directory (expected an mlafx artifact)")
        if not path.is_file():
            raise ArtifactError(f"{directory} has no {MANIFEST_FILE}: not an mlafx artifact")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise ArtifactError(f"{path} is not valid JSON: {error}") from None
        names = {f.name for f in dataclasses.fields(cls)}
        required = {
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        }
        if not isinstance(raw, dict) or not required <= raw.keys():
            missing = sorted(required - set(raw)) if isinstance(raw, dict) else sorted(required)
            raise ArtifactError(f"{path} lacks the field(s) {missing}")
        unknown = sorted(set(raw) - names)
        if unknown:
            raise ArtifactError(f"{path} has unknown field(s) {unknown} (a newer mlafx?)")
        return cls(**raw)


def config_from_dict(raw: dict[str, Any]) -> ModelConfig:
    """The inverse of ``ModelConfig.to_dict`` (JSON turned its tuples into lists)."""
    values = dict(raw)
    for f in dataclasses.fields(ModelConfig):
        if isinstance(values.get(f.name), list):
            values[f.name] = tuple(values[f.name])
    scaling = values.get("rope_scaling")
    if isinstance(scaling, dict) and "factors" in scaling:
        values["rope_scaling"] = LongRopeScaling(
            factors=tuple(scaling["factors"]), attention_factor=scaling["attention_factor"]
        )
    elif isinstance(scaling, dict):
        values["rope_scaling"] = YarnScaling(**scaling)
    return ModelConfig(**values)


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def file_entries(directory: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """The manifest's ``files``: sha256 and size of each named file of the directory."""
    return {
        name: {"sha256": sha256_file(directory / name), "bytes": (directory / name).stat().st_size}
        for name in names
    }


def custom_op_schemas(program: torch.export.ExportedProgram) -> dict[str, str]:
    """``{"mlafx::op": schema}`` of every mlafx op the program calls."""
    schemas = {}
    for node in program.graph.nodes:
        target = node.target
        if node.op == "call_function" and isinstance(target, torch._ops.OpOverload):
            if target.namespace == "mlafx":
                schemas[target.name()] = str(target._schema)
    return dict(sorted(schemas.items()))


def verify_artifact(directory: Path) -> Manifest:
    """Read and check an artifact before anything in it is loaded (see the module doc)."""
    import mlafx

    manifest = Manifest.read(directory)
    where = f"artifact {directory}"
    if manifest.artifact_version != ARTIFACT_VERSION:
        raise ArtifactError(
            f"{where} has layout version {manifest.artifact_version}; this mlafx reads "
            f"version {ARTIFACT_VERSION}: re-export it with this mlafx"
        )
    if manifest.format not in FORMATS:
        raise ArtifactError(f"{where} has unknown format {manifest.format!r}")
    for name, entry in manifest.files.items():
        path = directory / name
        if not path.is_file():
            raise ArtifactError(f"{where} is incomplete: {name} is missing")
        digest = sha256_file(path)
        if digest != entry["sha256"]:
            raise ArtifactError(
                f"{where}: {name} does not match its sha256 in {MANIFEST_FILE} (file "
                f"{digest[:16]}..., manifest {entry['sha256'][:16]}...): the file was modified "
                "or corrupted; nothing was loaded"
            )
    if manifest.mlafx_version != mlafx.__version__:
        raise ArtifactError(
            f"{where} was written by mlafx {manifest.mlafx_version}; this is mlafx "
            f"{mlafx.__version__}: re-export it with this version"
        )
    if manifest.format != "onnx" and manifest.torch_version != torch.__version__:
        raise ArtifactError(
            f"{where} ({manifest.format}) was written with torch {manifest.torch_version}; "
            f"torch {torch.__version__} is installed: re-export it, or install that torch"
        )
    if manifest.cache_layout_version != CACHE_LAYOUT_VERSION:
        raise ArtifactError(
            f"{where} writes cache layout {manifest.cache_layout_version}; this mlafx uses "
            f"{CACHE_LAYOUT_VERSION}: re-export it"
        )
    _check_custom_ops(manifest, where)
    missing = missing_cpu_flags(manifest.cpu.get("required_flags", []))
    if missing:
        raise ArtifactError(
            f"{where} holds code compiled for {manifest.cpu.get('aoti_cpu_isa') or 'another CPU'}"
            f" and this CPU lacks {', '.join(missing)}: export a portable 'pt2' or 'onnx' "
            "artifact, or export 'aoti' on a machine like this one"
        )
    return manifest


def _check_custom_ops(manifest: Manifest, where: str) -> None:
    if not manifest.custom_ops:
        return
    import mlafx.kernels  # noqa: F401  (loads the extension: registers the mlafx ops)

    for name, schema in manifest.custom_ops.items():
        namespace, _, op = name.partition("::")
        packet = getattr(getattr(torch.ops, namespace), op, None) if namespace == "mlafx" else None
        if packet is None:
            raise ArtifactError(f"{where} calls {name}, which this mlafx's kernels do not have")
        current = str(packet.default._schema)
        if current != schema:
            raise ArtifactError(
                f"{where} calls {name} with schema {schema!r}, but this mlafx's is "
                f"{current!r}: re-export it"
            )
