"""Convert a pruned checkpoint's weights to kernel-ready formats.

Per pruned tensor (from the sidecar ``prunekit.json``; without one, every default-prunable
2-D weight holding zeros counts as ``unstructured``) a format is chosen:

- an explicit format (``csr``, ``bsr``, ``nm``, ``bitmask``, ``dense``) where the tensor fits
  it, else ``dense`` (reported as a fallback);
- ``auto``: the smallest kernel-ready format (``csr``; ``bsr`` with the pattern's block shape;
  ``nm`` for N:M patterns; ``ks`` for Kronecker-sparse patterns), or ``dense`` when none is smaller.
  A Kronecker-sparse chain (``ks:.../...``, written by ``prunekit ks factorize``) is stored as its
  factors, recovered exactly from the stored product (``prune.kronecker.recover_factors``); only ``ks``
  (or ``dense``) can hold it. ``bitmask`` is storage-only
  (decoded to dense to compute) and is used only when asked for.

The output is one safetensors file: component ``"{name}.{component}"`` per sparse tensor,
other tensors under their own names, and the :class:`TensorEntry` list in the file's
``__metadata__["prunekit"]``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..errors import FormatError, PatternError
from ..formats import EncodedTensor, format_names, get_format
from ..formats.base import dtype_name
from ..io import Checkpoint, atomic_path, check_output, open_checkpoint
from ..io.safetensors_io import StreamingWriter
from ..prune import view_2d
from ..prune.patterns import NM, Block, KroneckerChain, KroneckerSparse, parse_pattern
from ..prune.select import is_default_prunable
from .runtime.manifest import TensorEntry

log = logging.getLogger(__name__)

KERNEL_FORMATS = ("csr", "bsr", "nm", "ks")  # computed as stored by prunekit's ops
FORMAT_CHOICES = ("auto", *sorted(format_names()))
METADATA_KEY = "prunekit"
Progress = Callable[[int, int, str], None]


def pattern_params(pattern: str | None) -> dict[str, int | str]:
    """Format parameters implied by a pattern string (block shape; n and m; a, b, c, d and/or ``patterns``)."""
    if not pattern:
        return {}
    pat = parse_pattern(pattern)
    if isinstance(pat, Block):
        return {"block_rows": pat.rows, "block_cols": pat.cols}
    if isinstance(pat, NM):
        return {"n": pat.n, "m": pat.m}
    if isinstance(pat, KroneckerSparse):
        return {"a": pat.a, "b": pat.b, "c": pat.c, "d": pat.d, "patterns": str(pat).removeprefix("ks:")}
    if isinstance(pat, KroneckerChain):
        return {"patterns": str(pat).removeprefix("ks:")}
    return {}


def candidate_formats(pattern: str | None, fmt: str) -> list[str]:
    """Formats to try, in preference order, for a tensor pruned with ``pattern``."""
    if fmt != "auto":
        return [fmt]
    params = pattern_params(pattern)
    if "patterns" in params:
        return ["ks"] if "a" not in params else ["ks", "csr"]
    names = ["csr"]
    if "block_rows" in params:
        names.insert(0, "bsr")
    if "n" in params:
        names.insert(0, "nm")
    return names


def encode_best(weight2d: torch.Tensor, pattern: str | None, fmt: str) -> tuple[EncodedTensor, str | None]:
    """Encode a pruned 2-D weight; returns the encoding and a fallback reason (or None).

    ``auto`` keeps the smallest candidate; dense wins when no candidate is smaller.
    """
    params = pattern_params(pattern)
    dense = get_format("dense").encode(weight2d, {})
    best, reasons = None, []
    for name in candidate_formats(pattern, fmt):
        if name == "dense":
            return dense, None
        try:
            if name == "ks" and "patterns" in params and "a" not in params:  # a chain: its factors
                from ..formats.ks import encode_factors
                from ..prune.kronecker import recover_factors

                enc = encode_factors(recover_factors(weight2d, str(pattern)).factors, weight2d.dtype)
            else:
                enc = get_format(name).encode(weight2d, params)
        except (FormatError, PatternError) as exc:
            reasons.append(str(exc))
            continue
        if best is None or enc.nbytes < best.nbytes:
            best = enc
    if best is None:
        return dense, "; ".join(reasons)
    if fmt == "auto" and best.nbytes >= dense.nbytes:
        return dense, None
    return best, None


def component_key(name: str, fmt: str, component: str) -> str:
    """Key of a component in the weights file: the tensor's own name for dense tensors."""
    return name if fmt == "dense" else f"{name}.{component}"


@dataclass
class Converted:
    """Result of :func:`iter_converted` for one tensor."""

    entry: TensorEntry
    encoded: EncodedTensor
    fallback: str | None = None


def pruned_tensors(ckpt: Checkpoint) -> dict[str, dict]:
    """Pruned tensors of a checkpoint: the sidecar's records, or inferred from zeros when there is none."""
    if ckpt.sidecar is not None:
        return {n: r for n, r in ckpt.sidecar["tensors"].items() if n in set(ckpt.names())}
    inferred = {}
    for name in ckpt.names():
        if is_default_prunable(name, len(ckpt.shape(name)), ckpt.is_floating(name)):
            t = ckpt.get(name)
            zeros = int((t == 0).sum())
            if zeros:
                inferred[name] = {"pattern": "unstructured", "sparsity": zeros / t.numel(), "method": "unknown"}
    return inferred


def iter_converted(ckpt: Checkpoint, fmt: str) -> Iterator[Converted]:
    """Encode every tensor of ``ckpt`` (pruned ones in ``fmt``, the rest dense), in checkpoint order.

    Raises:
        FormatError: unknown format name.
    """
    if fmt not in FORMAT_CHOICES:
        raise FormatError(f"unknown format {fmt!r}; choose one of {', '.join(FORMAT_CHOICES)}")
    pruned = pruned_tensors(ckpt)
    for name in ckpt.names():
        tensor = ckpt.get(name)
        record = pruned.get(name)
        fallback = None
        if record is not None and tensor.is_floating_point() and tensor.dim() >= 2:
            enc, fallback = encode_best(view_2d(tensor), record.get("pattern"), fmt)
            pattern, sparsity = record.get("pattern"), float(record.get("sparsity", 0.0))
        else:
            enc = EncodedTensor("dense", tuple(tensor.shape), dtype_name(tensor.dtype), {}, {"weight": tensor})
            pattern, sparsity = None, None
        entry = TensorEntry(
            name=name,
            format=enc.format,
            shape=list(enc.shape),
            orig_shape=list(tensor.shape),
            dtype=enc.dtype,
            params=dict(enc.params),
            components={c: component_key(name, enc.format, c) for c in enc.components},
            pattern=pattern,
            sparsity=sparsity,
            nbytes=enc.nbytes,
            dense_nbytes=tensor.numel() * tensor.element_size(),
        )
        yield Converted(entry, enc, fallback)


@dataclass
class ConvertResult:
    """Entries written, and the tensors that fell back to dense with the reason."""

    output: Path
    entries: list[TensorEntry] = field(default_factory=list)
    fallbacks: list[tuple[str, str]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    @property
    def dense_nbytes(self) -> int:
        return sum(e.dense_nbytes for e in self.entries)


def write_converted(ckpt: Checkpoint, path: Path, fmt: str, progress: Progress | None = None) -> ConvertResult:
    """Encode ``ckpt`` and write the weights file at ``path`` (not atomic: the caller's temp path)."""
    result = ConvertResult(path)
    names = ckpt.names()
    with StreamingWriter(path, {"format": "pt"}) as writer:
        for i, item in enumerate(iter_converted(ckpt, fmt)):
            for component, tensor in item.encoded.components.items():
                writer.write(item.entry.components[component], tensor)
            result.entries.append(item.entry)
            if item.fallback:
                result.fallbacks.append((item.entry.name, item.fallback))
            if progress:
                progress(i + 1, len(names), item.entry.name)
        writer.metadata[METADATA_KEY] = json.dumps([asdict(e) for e in result.entries])
    if result.fallbacks:
        log.warning(
            "%d tensors stored dense: %s", len(result.fallbacks), "; ".join(f"{n}: {r}" for n, r in result.fallbacks)
        )
    return result


def convert_checkpoint(
    source: str | Path, output: str | Path, fmt: str = "auto", overwrite: bool = False, progress: Progress | None = None
) -> ConvertResult:
    """Convert a pruned checkpoint to one safetensors file of kernel-ready formats.

    Raises:
        CheckpointError: unreadable source. FormatError: unknown format.
        OutputExistsError: ``output`` exists without ``overwrite``.
    """
    source, output = Path(source), Path(output)
    if fmt not in FORMAT_CHOICES:
        raise FormatError(f"unknown format {fmt!r}; choose one of {', '.join(FORMAT_CHOICES)}")
    check_output(output, overwrite, inputs=(source,))
    ckpt = open_checkpoint(source)
    with atomic_path(output, overwrite) as tmp:
        result = write_converted(ckpt, tmp, fmt, progress)
    result.output = output
    return result
