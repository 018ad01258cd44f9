"""N:M compressed format: ``n`` values per group of ``m`` plus packed in-group indices.

Components of a weight ``(M, K)`` with ``K % m == 0`` and at most ``n`` non-zeros per group:

- ``values``: ``(M, K / m * n)`` weight dtype; group ``g`` holds columns ``g*m + idx``, ascending.
  Groups with fewer than ``n`` non-zeros are filled with zeros at unused positions.
- ``metadata``: ``(M, ceil(K / m * n / per_byte))`` uint8: each in-group index in ``bits`` =
  the next power of two >= log2(m) bits, packed little-end first (2 bits for 2:4, as in
  NVIDIA's sparse tensor core metadata, Mishra et al. 2021; the kernel-specific reordering
  of 2:4 metadata for ``mma.sp`` is done by the kernel's own packing step).

``params``: ``n``, ``m``, ``bits``.
"""

from __future__ import annotations

import math

import torch

from .base import EncodedTensor, SparseFormat, dtype_name, register


def index_bits(m: int) -> int:
    """Bits stored per in-group index: a power of two >= log2(m), so indices never straddle bytes."""
    need = max(1, math.ceil(math.log2(m)))
    return 1 << math.ceil(math.log2(need))


def pack_indices(indices: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``indices: (rows, L)`` (values < 2**bits) into ``(rows, ceil(L * bits / 8))`` uint8."""
    per_byte = 8 // bits
    rows, length = indices.shape
    padded = torch.zeros(rows, -(-length // per_byte) * per_byte, dtype=torch.int32, device=indices.device)
    padded[:, :length] = indices
    shifts = torch.arange(per_byte, dtype=torch.int32, device=indices.device) * bits
    return (padded.reshape(rows, -1, per_byte) << shifts).sum(dim=-1).to(torch.uint8)


def unpack_indices(packed: torch.Tensor, bits: int, length: int) -> torch.Tensor:
    """Inverse of :func:`pack_indices`: ``(rows, length)`` int64."""
    per_byte = 8 // bits
    shifts = torch.arange(per_byte, dtype=torch.int32, device=packed.device) * bits
    fields = (packed.to(torch.int32)[..., None] >> shifts) & ((1 << bits) - 1)
    return fields.reshape(packed.shape[0], -1)[:, :length].long()


@register
class NMFormat(SparseFormat):
    """N:M compressed; see the module docstring. ``params`` needs ``n`` and ``m``."""

    name = "nm"

    def unfit_reason(self, dense: torch.Tensor, params: dict[str, int | str]) -> str | None:
        if "n" not in params or "m" not in params:
            return "needs an N:M pattern (params n and m)"
        n, m = int(params["n"]), int(params["m"])
        if dense.shape[1] % m:
            return f"in_features {dense.shape[1]} is not a multiple of M={m}"
        counts = (dense != 0).reshape(dense.shape[0], -1, m).sum(dim=-1)
        if bool((counts > n).any()):
            return f"tensor is not {n}:{m} sparse (a group has {int(counts.max())} non-zeros)"
        return None

    def encode(self, dense: torch.Tensor, params: dict[str, int | str]) -> EncodedTensor:
        self.check(dense, params)
        n, m = int(params["n"]), int(params["m"])
        rows, k = dense.shape
        groups = dense.reshape(rows, k // m, m)
        # Non-zeros first (stable, so ascending column), then unused positions to fill the group up to n.
        order = torch.argsort((groups == 0).to(torch.int8), dim=-1, stable=True)[..., :n]
        in_group = torch.sort(order, dim=-1).values
        values = torch.gather(groups, -1, in_group).reshape(rows, -1)
        bits = index_bits(m)
        metadata = pack_indices(in_group.reshape(rows, -1).to(torch.int32), bits)
        components = {"values": values.contiguous(), "metadata": metadata}
        return EncodedTensor(self.name, (rows, k), dtype_name(dense.dtype), {"n": n, "m": m, "bits": bits}, components)

    def decode(self, encoded: EncodedTensor) -> torch.Tensor:
        n, m, bits = (int(encoded.params[key]) for key in ("n", "m", "bits"))
        rows, k = encoded.shape
        values = encoded.components["values"]
        in_group = unpack_indices(encoded.components["metadata"], bits, k // m * n).reshape(rows, k // m, n)
        groups = torch.zeros(rows, k // m, m, dtype=encoded.torch_dtype, device=values.device)
        groups.scatter_(-1, in_group, values.reshape(rows, k // m, n))
        return groups.reshape(rows, k)
