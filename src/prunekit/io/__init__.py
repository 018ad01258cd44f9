"""Checkpoint I/O: safe loading (no pickle execution), streaming safetensors, atomic outputs."""

from .atomic import atomic_path, check_output
from .checkpoint import Checkpoint, open_checkpoint, sha256_file, sidecar_path

__all__ = ["Checkpoint", "open_checkpoint", "sha256_file", "sidecar_path", "atomic_path", "check_output"]
