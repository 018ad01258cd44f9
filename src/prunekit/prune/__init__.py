"""Pruning a checkpoint: select layers -> score -> mask by pattern -> write the pruned checkpoint.

``prune_checkpoint`` streams the source one tensor at a time and writes the output in the
same kind as the input (HF directory, ``.safetensors`` file or torch state dict), plus a
sidecar ``prunekit.json`` recording per pruned tensor its pattern, achieved sparsity and
method. The input is never modified; the output appears atomically.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .. import __version__
from ..errors import PatternError
from ..io import Checkpoint, atomic_path, check_output, open_checkpoint, sidecar_path
from ..io.checkpoint import HF_PICKLE, HF_SAFETENSORS
from ..io.safetensors_io import StreamingWriter
from .criteria import get_criterion
from .patterns import Pattern, parse_pattern
from .select import select_tensors

__all__ = ["PrunedTensor", "PruneResult", "prune_tensor", "prune_checkpoint", "view_2d"]

log = logging.getLogger(__name__)
Progress = Callable[[int, int, str], None]


@dataclass(frozen=True)
class PrunedTensor:
    """Sidecar record of one pruned tensor."""

    name: str
    shape: tuple[int, ...]
    pattern: str
    sparsity: float
    target_sparsity: float
    method: str


@dataclass
class PruneResult:
    """What :func:`prune_checkpoint` did: pruned tensors and skipped ones with the reason."""

    output: Path
    pruned: list[PrunedTensor] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)


def view_2d(tensor: torch.Tensor) -> torch.Tensor:
    """``(out, in, *kernel)`` conv weights as ``(out, in * prod(kernel))``; 2-D tensors unchanged."""
    return tensor.reshape(tensor.shape[0], -1)


def prune_tensor(weight: torch.Tensor, pattern: Pattern, sparsity: float, method: str = "magnitude") -> torch.Tensor:
    """Return a pruned copy of ``weight`` (2-D, or conv viewed as 2-D), same shape and dtype.

    Raises:
        PatternError: the shape cannot take the pattern, or an unknown method.
    """
    w2d = view_2d(weight)
    reason = pattern.unfit_reason(tuple(w2d.shape))
    if reason is not None:
        raise PatternError(reason)
    mask = pattern.mask(get_criterion(method)(w2d), sparsity)
    return (w2d * mask.to(w2d.dtype)).reshape(weight.shape)


def _write_sidecar(path: Path, ckpt: Checkpoint, result: PruneResult) -> None:
    data = {
        "prunekit_version": __version__,
        "source": {"path": str(ckpt.path), "kind": ckpt.kind, "sha256": ckpt.source_sha256()},
        "tensors": {t.name: {k: v for k, v in asdict(t).items() if k != "name"} for t in result.pruned},
        "skipped": {name: reason for name, reason in result.skipped},
    }
    path.write_text(json.dumps(data, indent=2) + "\n")


def prune_checkpoint(
    source: str | Path,
    output: str | Path,
    pattern: str | Pattern,
    sparsity: float | None = None,
    method: str = "magnitude",
    include: list[str] | None = None,
    exclude: list[str] | None = None,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> PruneResult:
    """Prune a checkpoint to ``pattern`` at ``sparsity`` and write it to ``output``.

    Args:
        source: HF model directory, ``.safetensors`` file or torch state dict.
        output: same kind as ``source`` (directory for HF, file otherwise).
        pattern: ``unstructured`` | ``block:RxC`` | ``N:M`` (or a :class:`Pattern`).
        sparsity: fraction of zeros in [0, 1) per tensor; implied by N:M.
        method: pruning criterion (``magnitude``).
        include / exclude: regexes selecting tensors (see :mod:`prunekit.prune.select`).
        progress: callback ``(done, total, tensor_name)``.

    Raises:
        CheckpointError: unreadable source. PatternError: bad pattern/sparsity/method, nothing
        prunable, or an explicitly included tensor that cannot take the pattern.
        OutputExistsError: output exists without ``overwrite``.
    """
    source, output = Path(source), Path(output)
    pat = parse_pattern(pattern) if isinstance(pattern, str) else pattern
    target = pat.check_sparsity(sparsity)
    get_criterion(method)
    check_output(output, overwrite, inputs=(source,))
    ckpt = open_checkpoint(source)
    names = ckpt.names()
    selection = select_tensors([(n, len(ckpt.shape(n)), ckpt.is_floating(n)) for n in names], include, exclude)

    result = PruneResult(output)
    to_prune = []
    for name in selection.selected:
        shape = ckpt.shape(name)
        reason = pat.unfit_reason((shape[0], int(torch.Size(shape[1:]).numel())))
        if reason is None:
            to_prune.append(name)
        elif name in selection.explicit:
            raise PatternError(f"{name}: cannot take pattern {pat}: {reason}")
        else:
            result.skipped.append((name, reason))
    if not to_prune:
        why = f" ({result.skipped[0][0]}: {result.skipped[0][1]})" if result.skipped else ""
        raise PatternError(f"nothing to prune in {source} with pattern {pat}: no selected tensor fits it{why}")
    if result.skipped:
        names_skipped = ", ".join(n for n, _ in result.skipped)
        log.warning("skipped %d tensors that cannot take %s: %s", len(result.skipped), pat, names_skipped)

    prune_set = set(to_prune)

    def process(name: str) -> torch.Tensor:
        tensor = ckpt.get(name)
        if name not in prune_set:
            return tensor
        pruned = prune_tensor(tensor, pat, target, method)
        zeros = int((pruned == 0).sum())
        result.pruned.append(PrunedTensor(name, tuple(tensor.shape), str(pat), zeros / pruned.numel(), target, method))
        return pruned

    is_dir = ckpt.kind == "hf"
    with atomic_path(output, overwrite, directory=is_dir) as tmp:
        weights_path = tmp / (HF_SAFETENSORS if ckpt.is_safetensors else HF_PICKLE) if is_dir else tmp
        if is_dir:
            for rel in ckpt.config_files():
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ckpt.path / rel, tmp / rel)
        if ckpt.is_safetensors:
            with StreamingWriter(weights_path, {"format": "pt"}) as writer:
                for i, name in enumerate(names):
                    writer.write(name, process(name))
                    if progress:
                        progress(i + 1, len(names), name)
        else:
            state = {}
            for i, name in enumerate(names):
                state[name] = process(name)
                if progress:
                    progress(i + 1, len(names), name)
            torch.save(state, weights_path)
        if is_dir:
            _write_sidecar(sidecar_path(tmp), ckpt, result)
    if not is_dir:
        with atomic_path(sidecar_path(output), overwrite=True) as tmp_side:
            _write_sidecar(tmp_side, ckpt, result)
    return result
