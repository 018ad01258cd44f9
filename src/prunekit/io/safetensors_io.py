"""Streaming safetensors reading and writing.

Reading goes through the ``safetensors`` library (memory-mapped, one tensor at a time)
after a header check of our own that turns truncated or corrupt files into a one-line
:class:`CheckpointError`. Writing streams tensors one by one into the safetensors layout
(8-byte little-endian header length, JSON header, raw little-endian data), so pruning a
model never holds a second full copy of it; ``safetensors.safe_open`` reads the result.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from pathlib import Path

import torch

from ..errors import CheckpointError

DTYPE_CODES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit


def read_header(path: Path) -> dict:
    """Parse and sanity-check a safetensors header.

    Returns:
        The header dict (tensor entries plus optional ``__metadata__``).

    Raises:
        CheckpointError: the file is too short, the header is not JSON, or the data
            section is truncated (a tensor's ``data_offsets`` run past the end of the file).
    """
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) < 8:
                raise CheckpointError(f"{path}: not a safetensors file (only {size} bytes)")
            (header_len,) = struct.unpack("<Q", raw_len)
            if header_len > min(_MAX_HEADER_BYTES, size - 8):
                raise CheckpointError(f"{path}: corrupt safetensors header (length {header_len} > file size)")
            header = json.loads(f.read(header_len))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(f"{path}: corrupt safetensors header (not valid JSON)") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header")
    data_size = size - 8 - header_len
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            end = int(entry["data_offsets"][1])
        except (KeyError, TypeError, IndexError, ValueError):
            raise CheckpointError(f"{path}: corrupt safetensors entry for {name!r}") from None
        if end > data_size:
            raise CheckpointError(f"{path}: truncated safetensors file ({name!r} ends past the end of the data)")
    return header


class StreamingWriter:
    """Write a safetensors file tensor by tensor.

    Args:
        path: file to write (the caller makes it atomic by writing to a temp path).
        entries: ``(name, dtype, shape)`` for every tensor, in the order they will be written.
        metadata: string-to-string ``__metadata__``.

    Use as a context manager; call :meth:`write` once per entry, in order.
    """

    def __init__(self, path: Path, entries: Iterable[tuple[str, torch.dtype, tuple[int, ...]]], metadata=None):
        self._entries = list(entries)
        header: dict = {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        offset = 0
        for name, dtype, shape in self._entries:
            if dtype not in DTYPE_CODES:
                raise CheckpointError(f"cannot store {name!r}: dtype {dtype} has no safetensors code")
            nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": DTYPE_CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self._file = open(path, "wb")
        self._file.write(struct.pack("<Q", len(blob)))
        self._file.write(blob)
        self._next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append the next tensor; its name, dtype and shape must match the declared entry."""
        want_name, want_dtype, want_shape = self._entries[self._next]
        if name != want_name or tensor.dtype != want_dtype or tuple(tensor.shape) != tuple(want_shape):
            raise ValueError(f"tensor {name} {tensor.dtype} {tuple(tensor.shape)} does not match entry {want_name}")
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        self._file.write(memoryview(data.numpy()))
        self._next += 1

    def close(self) -> None:
        self._file.close()
        if self._next != len(self._entries):
            raise ValueError(f"only {self._next} of {len(self._entries)} tensors were written")

    def __enter__(self) -> StreamingWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self._file.close()


def save_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """Write a dict of tensors with :class:`StreamingWriter` (insertion order)."""
    entries = [(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]
    with StreamingWriter(path, entries, metadata) as writer:
        for name, t in tensors.items():
            writer.write(name, t)
