"""Streaming safetensors reading and writing.

Reading goes through the ``safetensors`` library (memory-mapped, one tensor at a time)
after a header check of our own that turns truncated or corrupt files into a one-line
:class:`CheckpointError`. Writing streams tensors one by one into the safetensors layout
(8-byte little-endian header length, JSON header, raw little-endian data), so pruning a
model never holds a second full copy of it; ``safetensors.safe_open`` reads the result.
"""

from __future__ import annotations

import json
import shutil
import struct
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
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit


def read_header(path: Path) -> dict:
    """Parse and sanity-check a safetensors header.

    Returns:
        The header dict: tensor entries, optional ``__metadata__``, and ``__header_nbytes__``
        (the JSON header's length, added here).

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
    header["__header_nbytes__"] = header_len
    for name, entry in header.items():
        if name in ("__metadata__", "__header_nbytes__"):
            continue
        try:
            end = int(entry["data_offsets"][1])
        except (KeyError, TypeError, IndexError, ValueError):
            raise CheckpointError(f"{path}: corrupt safetensors entry for {name!r}") from None
        if end > data_size:
            raise CheckpointError(f"{path}: truncated safetensors file ({name!r} ends past the end of the data)")
    return header


class StreamingWriter:
    """Write a safetensors file tensor by tensor, holding at most one tensor in memory.

    Tensor data is appended to a spool file beside ``path``; :meth:`close` writes the header
    (which must come first in the format) and copies the spool after it.

    Args:
        path: file to write (the caller makes it atomic by writing to a temp path).
        metadata: string-to-string ``__metadata__``; may be completed before :meth:`close`.
    """

    def __init__(self, path: Path, metadata: dict[str, str] | None = None):
        self.path = Path(path)
        self.metadata = dict(metadata or {})
        self._spool_path = self.path.with_name(self.path.name + ".spool")
        self._spool = open(self._spool_path, "wb")
        self._header: dict = {}
        self._offset = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append a tensor (any device; copied to CPU).

        Raises:
            CheckpointError: duplicate name, or a dtype safetensors cannot store.
        """
        if name in self._header:
            raise CheckpointError(f"cannot store {name!r} twice")
        if tensor.dtype not in DTYPE_CODES:
            raise CheckpointError(f"cannot store {name!r}: dtype {tensor.dtype} has no safetensors code")
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        self._spool.write(memoryview(data.numpy()))
        nbytes = data.numel()
        entry = {
            "dtype": DTYPE_CODES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [self._offset, self._offset + nbytes],
        }
        self._header[name] = entry
        self._offset += nbytes

    def close(self) -> None:
        """Write header + data to ``path`` and remove the spool."""
        self._spool.close()
        header = dict(self._header)
        if self.metadata:
            header = {"__metadata__": {str(k): str(v) for k, v in self.metadata.items()}, **header}
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        try:
            with open(self.path, "wb") as out, open(self._spool_path, "rb") as spool:
                out.write(struct.pack("<Q", len(blob)))
                out.write(blob)
                shutil.copyfileobj(spool, out, 1 << 22)
        finally:
            self._spool_path.unlink(missing_ok=True)

    def abort(self) -> None:
        self._spool.close()
        self._spool_path.unlink(missing_ok=True)

    def __enter__(self) -> StreamingWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def read_tensor(path: Path, header: dict, name: str) -> torch.Tensor:
    """Read one tensor with plain file reads (no memory map: only this tensor becomes resident).

    Raises:
        CheckpointError: unknown dtype or a short read.
    """
    entry = header[name]
    dtype = CODE_DTYPES.get(entry["dtype"])
    if dtype is None:
        raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {entry['dtype']}")
    begin, end = entry["data_offsets"]
    header_len = 8 + header["__header_nbytes__"] if "__header_nbytes__" in header else None
    with open(path, "rb") as f:
        if header_len is None:
            (n,) = struct.unpack("<Q", f.read(8))
            header_len = 8 + n
        f.seek(header_len + begin)
        buf = bytearray(end - begin)
        if f.readinto(buf) != len(buf):
            raise CheckpointError(f"{path}: truncated data for tensor {name!r}")
    if not buf:
        return torch.empty(entry["shape"], dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype).reshape(entry["shape"])


def save_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """Write a dict of tensors with :class:`StreamingWriter` (insertion order)."""
    with StreamingWriter(path, metadata) as writer:
        for name, t in tensors.items():
            writer.write(name, t)
