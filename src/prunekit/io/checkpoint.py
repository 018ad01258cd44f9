"""Checkpoint loading without executing pickles.

Three kinds of checkpoint are read:

- ``hf``: a Hugging Face model directory (``config.json`` + ``model.safetensors``, sharded
  ``model.safetensors.index.json``, or ``pytorch_model.bin``);
- ``safetensors``: a single ``.safetensors`` file;
- ``torch``: a pickled state dict (``.pt``/``.pth``/``.bin``) loaded with
  ``torch.load(..., weights_only=True)`` only.

Safetensors are read lazily (memory-mapped, one tensor at a time). A pruned checkpoint
carries a sidecar ``prunekit.json`` (see :mod:`prunekit.prune`).
"""

from __future__ import annotations

import hashlib
import json
import pickle
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import CheckpointError
from .safetensors_io import CODE_DTYPES, read_header, read_tensor

HF_SAFETENSORS = "model.safetensors"
HF_SAFETENSORS_INDEX = "model.safetensors.index.json"
HF_PICKLE = "pytorch_model.bin"
HF_WEIGHT_FILES = (HF_SAFETENSORS, HF_SAFETENSORS_INDEX, HF_PICKLE)
SIDECAR = "prunekit.json"
TORCH_SUFFIXES = (".pt", ".pth", ".bin")


def sha256_file(path: Path, chunk_bytes: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in 4 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass
class Checkpoint:
    """An opened checkpoint: tensor names, shapes and dtypes up front, tensors on demand.

    Attributes:
        path: what the user named (directory or file).
        kind: ``hf`` | ``safetensors`` | ``torch``.
        weight_files: files holding the tensors.
        sidecar: the parsed prunekit sidecar, or None for an unpruned checkpoint.
    """

    path: Path
    kind: str
    weight_files: list[Path]
    sidecar: dict | None = None
    _where: dict[str, Path] = field(default_factory=dict, repr=False)
    _headers: dict[str, dict] = field(default_factory=dict, repr=False)
    _state: dict[str, torch.Tensor] | None = field(default=None, repr=False)
    _file_headers: dict[Path, dict] = field(default_factory=dict, repr=False)

    @property
    def is_safetensors(self) -> bool:
        return self._state is None

    def names(self) -> list[str]:
        """Tensor names in file order."""
        return list(self._where) if self._state is None else list(self._state)

    def shape(self, name: str) -> tuple[int, ...]:
        if self._state is not None:
            return tuple(self._state[name].shape)
        return tuple(self._headers[name]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        if self._state is not None:
            return self._state[name].dtype
        return CODE_DTYPES.get(self._headers[name]["dtype"], torch.uint8)

    def is_floating(self, name: str) -> bool:
        return self.dtype(name).is_floating_point

    def get(self, name: str) -> torch.Tensor:
        """Load one tensor (a fresh CPU tensor for safetensors).

        Raises:
            CheckpointError: the tensor cannot be read (corrupt data).
        """
        if self._state is not None:
            return self._state[name]
        path = self._where[name]
        try:
            return read_tensor(path, self._file_headers[path], name)
        except (OSError, RuntimeError, ValueError) as exc:
            raise CheckpointError(f"{path}: cannot read tensor {name!r} ({exc})") from None

    def config_files(self) -> list[Path]:
        """Non-weight files of an HF directory (config, tokenizer, pooling modules), relative paths."""
        if self.kind != "hf":
            return []
        skip = set(HF_WEIGHT_FILES) | {SIDECAR} | {p.name for p in self.weight_files}
        files = []
        for p in sorted(self.path.rglob("*")):
            rel = p.relative_to(self.path)
            if p.is_file() and rel.as_posix() not in skip and not rel.parts[0].startswith("."):
                files.append(rel)
        return files

    def hf_config(self) -> dict | None:
        if self.kind != "hf":
            return None
        return json.loads((self.path / "config.json").read_text())

    def source_sha256(self) -> str:
        """sha256 over the weight files, in order (hex)."""
        if len(self.weight_files) == 1:
            return sha256_file(self.weight_files[0])
        digest = hashlib.sha256()
        for p in self.weight_files:
            digest.update(sha256_file(p).encode())
        return digest.hexdigest()


def sidecar_path(path: Path) -> Path:
    """Where the prunekit sidecar of a checkpoint lives (``DIR/prunekit.json`` or ``FILE.prunekit.json``)."""
    return path / SIDECAR if path.is_dir() else path.with_name(path.name + "." + SIDECAR)


def _load_sidecar(path: Path) -> dict | None:
    side = sidecar_path(path)
    if not side.is_file():
        return None
    try:
        data = json.loads(side.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(f"{side}: not valid JSON") from None
    if not isinstance(data, dict) or not isinstance(data.get("tensors"), dict):
        raise CheckpointError(f"{side}: not a prunekit sidecar (no 'tensors' map)")
    return data


def _load_torch_state(path: Path) -> dict[str, torch.Tensor]:
    try:
        # torch warns about legacy files written with another pickle protocol; the error below (if any) is the one line
        # a user sees, so the warning is not printed beside it
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
            try:
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as exc:  # legacy (non-zip) serialization cannot be memory-mapped
                if "mmap" not in str(exc):
                    raise
                state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else "unsupported object"
        raise CheckpointError(f"{path}: refused by torch.load(weights_only=True): {first}") from None
    except (RuntimeError, EOFError, ValueError, OSError, AttributeError, ImportError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{path}: not a readable torch checkpoint ({first})") from None
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in state.items()):
        raise CheckpointError(f"{path}: expected a state dict (a mapping of names to tensors)")
    if not state:
        raise CheckpointError(f"{path}: the state dict is empty")
    return state


def _open_safetensors(ckpt: Checkpoint) -> Checkpoint:
    for path in ckpt.weight_files:
        header = ckpt._file_headers[path] = read_header(path)
        tensors = [(name, entry) for name, entry in header.items() if not name.startswith("__")]
        for name, entry in sorted(tensors, key=lambda item: item[1]["data_offsets"][0]):  # file order
            ckpt._where[name] = path
            ckpt._headers[name] = entry
    if not ckpt._where:
        raise CheckpointError(f"{ckpt.path}: the checkpoint holds no tensors")
    return ckpt


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Open an HF directory, a ``.safetensors`` file, or a torch state dict.

    Raises:
        CheckpointError: missing path, unknown kind, corrupt/truncated file, or a pickle
            that ``weights_only`` refuses.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {path}")
    sidecar = _load_sidecar(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise CheckpointError(f"{path}: a Hugging Face model directory needs config.json")
        if (path / HF_SAFETENSORS).is_file():
            return _open_safetensors(Checkpoint(path, "hf", [path / HF_SAFETENSORS], sidecar))
        if (path / HF_SAFETENSORS_INDEX).is_file():
            try:
                index = json.loads((path / HF_SAFETENSORS_INDEX).read_text())
                files = sorted({path / f for f in index["weight_map"].values()})
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
                raise CheckpointError(f"{path / HF_SAFETENSORS_INDEX}: not a valid safetensors index") from None
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise CheckpointError(f"{path}: shard files missing: {', '.join(missing)}")
            return _open_safetensors(Checkpoint(path, "hf", files, sidecar))
        if (path / HF_PICKLE).is_file():
            ckpt = Checkpoint(path, "hf", [path / HF_PICKLE], sidecar)
            ckpt._state = _load_torch_state(path / HF_PICKLE)
            return ckpt
        raise CheckpointError(f"{path}: no model.safetensors or pytorch_model.bin in the directory")
    if path.suffix == ".safetensors":
        return _open_safetensors(Checkpoint(path, "safetensors", [path], sidecar))
    if path.suffix in TORCH_SUFFIXES:
        ckpt = Checkpoint(path, "torch", [path], sidecar)
        ckpt._state = _load_torch_state(path)
        return ckpt
    raise CheckpointError(f"{path}: unknown checkpoint kind (expected an HF directory, .safetensors, .pt or .bin)")
