"""The package manifest: a typed schema (stdlib dataclasses), validated at load, and file hashes.

``manifest.json`` holds the schema version, the source checkpoint and its sha256, the model
description, one :class:`TensorEntry` per stored weight, the sha256 of every other file
of the package, and what was tuned at export for the device it ran on (``tuning``, optional: the
cuSPARSELt configuration ids of the 2:4 layers, ``kernels/cslt_tune.py``). Stdlib + errors only: it
runs in the exported ``runtime/``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from ...errors import IntegrityError

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
WEIGHTS = "weights.safetensors"


def sha256_file(path: Path, chunk_bytes: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in 4 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def _typed(where: str, data: dict, spec: dict[str, type | tuple[type, ...]]) -> dict:
    if not isinstance(data, dict):
        raise IntegrityError(f"manifest: {where} must be an object")
    unknown = set(data) - set(spec)
    if unknown:
        raise IntegrityError(f"manifest: {where} has unknown key {sorted(unknown)[0]!r}")
    for key, typ in spec.items():
        if key not in data:
            raise IntegrityError(f"manifest: {where} is missing {key!r}")
        value = data[key]
        if not isinstance(value, typ) or (
            isinstance(value, bool) and bool not in (typ if isinstance(typ, tuple) else (typ,))
        ):
            raise IntegrityError(f"manifest: {where}.{key} has the wrong type ({type(value).__name__})")
    return data


@dataclass(frozen=True)
class TensorEntry:
    """One stored tensor.

    Attributes:
        name: the tensor's name in the model's state dict.
        format: storage format (``dense``, ``csr``, ``bsr``, ``nm``, ``bitmask``).
        shape: the 2-D shape that was encoded ``(out_features, in_features)``; the tensor's own
            shape for dense tensors.
        orig_shape: the tensor's shape in the model (differs from ``shape`` for conv weights).
        dtype: dtype name (``float32``...).
        params: format parameters.
        components: component name -> key in ``weights.safetensors``.
        pattern / sparsity: how it was pruned (None for tensors that were not pruned).
        nbytes: exact stored bytes; dense_nbytes: bytes of the dense tensor.
    """

    name: str
    format: str
    shape: list[int]
    orig_shape: list[int]
    dtype: str
    params: dict
    components: dict
    pattern: str | None
    sparsity: float | None
    nbytes: int
    dense_nbytes: int

    @property
    def bias_name(self) -> str | None:
        """The name the layer's bias has in the state dict (``fc.weight`` -> ``fc.bias``), or None for a tensor whose
        name does not end in ``weight``."""
        return self.name[: -len("weight")] + "bias" if self.name.endswith("weight") else None

    @classmethod
    def from_dict(cls, data: dict) -> TensorEntry:
        spec = {
            "name": str,
            "format": str,
            "shape": list,
            "orig_shape": list,
            "dtype": str,
            "params": dict,
            "components": dict,
            "pattern": (str, type(None)),
            "sparsity": (float, int, type(None)),
            "nbytes": int,
            "dense_nbytes": int,
        }
        _typed(f"tensor {data.get('name', '?') if isinstance(data, dict) else '?'}", data, spec)
        return cls(**data)


_CSLT_RECORD = {
    "device": str,
    "cusparselt_version": (int, type(None)),
    "torch": str,
    "tokens": list,
    "elapsed_s": (float, int),
    "configs": list,
}
_CSLT_CONFIG = {
    "m": int,
    "k": int,
    "dtype": str,
    "x_row": bool,
    "bias": bool,
    "n_bucket": int,
    "config_id": int,
    "failed": (str, type(None)),
}


def _check_tuning(tuning: dict) -> None:
    """Validate the optional ``tuning`` object: ``{"cslt": record}`` with the record of
    ``kernels/cslt_tune.TuneResult.to_dict``.

    Raises:
        IntegrityError: unknown or missing keys, or wrong types.
    """
    unknown = set(tuning) - {"cslt"}
    if unknown:
        raise IntegrityError(f"manifest: tuning has unknown key {sorted(unknown)[0]!r}")
    if "cslt" in tuning:
        record = _typed("tuning.cslt", tuning["cslt"], _CSLT_RECORD)
        for i, config in enumerate(record["configs"]):
            where = f"tuning.cslt.configs[{i}]"
            _typed(where, config, _CSLT_CONFIG)
            if config["dtype"] not in ("float16", "bfloat16"):
                raise IntegrityError(f"manifest: {where}.dtype must be float16 or bfloat16, got {config['dtype']!r}")
            bucket = config["n_bucket"]
            if bucket < 1 or bucket & (bucket - 1):
                raise IntegrityError(f"manifest: {where}.n_bucket must be a power of two, got {bucket}")


@dataclass(frozen=True)
class Manifest:
    """The whole manifest; see the module docstring."""

    schema_version: int
    prunekit_version: str
    created: str
    source: dict
    model: dict
    tensors: list[TensorEntry]
    files: dict[str, str] = field(default_factory=dict)
    tuning: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict) -> Manifest:
        """Validate and build.

        Raises:
            IntegrityError: unknown or missing keys, wrong types, or an unsupported schema version.
        """
        spec = {
            f.name: (list if f.name == "tensors" else dict if f.name in ("source", "model", "files", "tuning") else str)
            for f in fields(cls)
        }
        spec["schema_version"] = int
        if isinstance(data, dict) and "tuning" not in data:  # optional: packages written before it existed
            data = {**data, "tuning": {}}
        _typed("root", data, spec)
        if data["schema_version"] != SCHEMA_VERSION:
            raise IntegrityError(
                f"manifest: schema_version {data['schema_version']} is not supported (expected {SCHEMA_VERSION})"
            )
        _typed(
            "model", data["model"], {"kind": str, "architecture": (str, type(None)), "config_dir": (str, type(None))}
        )
        _check_tuning(data["tuning"])
        tensors = [TensorEntry.from_dict(t) for t in data["tensors"]]
        return cls(**{**data, "tensors": tensors})

    def to_dict(self) -> dict:
        return asdict(self)


def read_manifest(package: Path) -> Manifest:
    """Parse and validate ``package/manifest.json``.

    Raises:
        IntegrityError: missing, unreadable or invalid manifest.
    """
    path = Path(package) / MANIFEST
    if not path.is_file():
        raise IntegrityError(f"{package}: no {MANIFEST} (not a prunekit package)")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise IntegrityError(f"{path}: not valid JSON") from None
    return Manifest.from_dict(data)


def verify_files(package: Path, manifest: Manifest) -> None:
    """Check the sha256 of every file the manifest lists.

    Raises:
        IntegrityError: a listed file is missing or its hash differs.
    """
    package = Path(package)
    if WEIGHTS not in manifest.files:
        raise IntegrityError(f"manifest: {WEIGHTS} is not listed")
    for rel, expected in manifest.files.items():
        path = package / rel
        if ".." in Path(rel).parts or not path.is_file():
            raise IntegrityError(f"{package}: file {rel} listed in the manifest is missing")
        if sha256_file(path) != expected:
            raise IntegrityError(f"{package}: {rel} does not match its sha256 in the manifest (tampered or corrupt)")
