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
from .calibration import DEFAULT_MAX_LENGTH
from .criteria import CALIBRATED, check_method, get_criterion
from .patterns import Pattern, parse_pattern
from .select import select_tensors

__all__ = [
    "PrunedTensor",
    "PruneResult",
    "prune_tensor",
    "prune_checkpoint",
    "view_2d",
    "write_checkpoint",
    "calibrated_prune",
]

log = logging.getLogger(__name__)
Progress = Callable[[int, int, str], None]
DEFAULT_CALIB_SAMPLES = 128  # calibration sequences (SparseGPT and Wanda use 128 sequences)


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


def write_checkpoint(
    ckpt: Checkpoint,
    output: Path,
    tensor: Callable[[str], torch.Tensor],
    result: PruneResult,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> None:
    """Write every tensor of ``ckpt`` (as returned by ``tensor(name)``) to ``output``, same kind as ``ckpt``.

    HF directories get their config/tokenizer files copied and ``prunekit.json`` inside; files get
    ``OUTPUT.prunekit.json`` next to them. The sidecar is written after all tensors were produced,
    so ``tensor`` may append to ``result.pruned``. Everything appears atomically.
    """
    names = ckpt.names()
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
                    writer.write(name, tensor(name))
                    if progress:
                        progress(i + 1, len(names), name)
        else:
            state = {}
            for i, name in enumerate(names):
                state[name] = tensor(name)
                if progress:
                    progress(i + 1, len(names), name)
            torch.save(state, weights_path)
        if is_dir:
            _write_sidecar(sidecar_path(tmp), ckpt, result)
    if not is_dir:
        with atomic_path(sidecar_path(output), overwrite=True) as tmp_side:
            _write_sidecar(tmp_side, ckpt, result)


def fit_targets(
    ckpt: Checkpoint, selection_names: list[str], explicit: set[str], pat: Pattern, result: PruneResult
) -> list[str]:
    """The selected tensors whose 2-D view fits ``pat``; the others go to ``result.skipped``.

    Raises:
        PatternError: an explicitly included tensor does not fit.
    """
    fit = []
    for name in selection_names:
        shape = ckpt.shape(name)
        reason = pat.unfit_reason((shape[0], int(torch.Size(shape[1:]).numel())))
        if reason is None:
            fit.append(name)
        elif name in explicit:
            raise PatternError(f"{name}: cannot take pattern {pat}: {reason}")
        else:
            result.skipped.append((name, reason))
    return fit


def calibrated_prune(
    ckpt: Checkpoint,
    targets: dict[str, tuple[Pattern, float]],
    method: str,
    explicit: set[str],
    result: PruneResult,
    calibration: str | Path | list[str] | None = None,
    calib_samples: int = DEFAULT_CALIB_SAMPLES,
    max_length: int = DEFAULT_MAX_LENGTH,
    device: str | None = None,
    progress: Progress | None = None,
) -> dict[str, torch.Tensor]:
    """Run a calibrated method (Wanda, SparseGPT) on an HF checkpoint's model; pruned weights by tensor name.

    Tensors that are not ``nn.Linear`` weights of the model are skipped (an error when named
    explicitly). Returned tensors have the checkpoint's dtype, on the CPU.

    Raises:
        PatternError: not an HF directory, or an explicit tensor that is not a linear weight.
        DataError: unreadable calibration file. PrunekitError: the model cannot be built.
    """
    from ..data import calibration_texts, load_texts
    from .calibration import build_hf_model, linear_weight_names, prune_model, tokenize

    if ckpt.kind != "hf":
        raise PatternError(
            f"method {method!r} needs a Hugging Face model directory (it runs the model on calibration text); "
            f"{ckpt.path} is a {ckpt.kind} checkpoint"
        )
    if isinstance(calibration, list):
        texts = calibration[:calib_samples]
    elif calibration is not None:
        texts = load_texts(calibration, limit=calib_samples)
    else:
        texts = calibration_texts(calib_samples)
    model = build_hf_model(ckpt.path)
    linear_of = linear_weight_names(model)
    module_targets, tensor_of = {}, {}
    for name, spec in targets.items():
        module = linear_of.get(name)
        if module is None:
            if name in explicit:
                raise PatternError(f"{name}: {method} prunes nn.Linear weights only (it needs the layer's inputs)")
            result.skipped.append((name, f"not an nn.Linear weight ({method} needs the layer's inputs)"))
            continue
        module_targets[module] = spec
        tensor_of[module] = name
    if not module_targets:
        raise PatternError(f"nothing to prune in {ckpt.path} with {method}: no selected tensor is an nn.Linear weight")
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    batches = tokenize(ckpt.path, texts, max_length)
    prune_model(model, module_targets, method, batches, dev, progress)
    modules = dict(model.named_modules())
    return {
        tensor_of[m]: modules[m].weight.detach().to(ckpt.dtype(tensor_of[m])).cpu().reshape(ckpt.shape(tensor_of[m]))
        for m in module_targets
    }


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
    calibration: str | Path | list[str] | None = None,
    calib_samples: int = DEFAULT_CALIB_SAMPLES,
    max_length: int = DEFAULT_MAX_LENGTH,
    device: str | None = None,
) -> PruneResult:
    """Prune a checkpoint to ``pattern`` at ``sparsity`` and write it to ``output``.

    Args:
        source: HF model directory, ``.safetensors`` file or torch state dict.
        output: same kind as ``source`` (directory for HF, file otherwise).
        pattern: ``unstructured`` | ``block:RxC`` | ``N:M`` (or a :class:`Pattern`).
        sparsity: fraction of zeros in [0, 1) per tensor; implied by N:M.
        method: ``magnitude`` | ``wanda`` | ``sparsegpt`` (the last two need an HF directory:
            they run the model on calibration text, see :mod:`prunekit.prune.calibration`).
        include / exclude: regexes selecting tensors (see :mod:`prunekit.prune.select`).
        progress: callback ``(done, total, name)``.
        calibration: text file (lines or JSON lines with ``text``) or a list of texts; default:
            the standard-library docstring corpus (:mod:`prunekit.data.corpus`).
        calib_samples: number of calibration sequences.
        max_length: tokens per calibration sequence.
        device: where calibrated methods run (default: cuda when available, else cpu).

    Raises:
        CheckpointError: unreadable source. PatternError: bad pattern/sparsity/method, nothing
        prunable, an explicitly included tensor that cannot take the pattern, or a calibrated
        method on a checkpoint that is not an HF directory. DataError: bad calibration file.
        OutputExistsError: output exists without ``overwrite``.
    """
    source, output = Path(source), Path(output)
    pat = parse_pattern(pattern) if isinstance(pattern, str) else pattern
    target = pat.check_sparsity(sparsity)
    check_method(method)
    if calib_samples < 1:
        raise PatternError(f"--calib-samples must be at least 1, got {calib_samples}")
    check_output(output, overwrite, inputs=(source,))
    ckpt = open_checkpoint(source)
    if method in CALIBRATED and ckpt.kind != "hf":
        raise PatternError(
            f"method {method!r} needs a Hugging Face model directory (it runs the model on calibration text); "
            f"{source} is a {ckpt.kind} checkpoint"
        )
    names = ckpt.names()
    selection = select_tensors([(n, len(ckpt.shape(n)), ckpt.is_floating(n)) for n in names], include, exclude)

    result = PruneResult(output)
    to_prune = fit_targets(ckpt, selection.selected, selection.explicit, pat, result)
    if not to_prune:
        why = f" ({result.skipped[0][0]}: {result.skipped[0][1]})" if result.skipped else ""
        raise PatternError(f"nothing to prune in {source} with pattern {pat}: no selected tensor fits it{why}")

    calibrated: dict[str, torch.Tensor] = {}
    if method in CALIBRATED:
        targets = {name: (pat, target) for name in to_prune}
        calibrated = calibrated_prune(
            ckpt, targets, method, selection.explicit, result, calibration, calib_samples, max_length, device, progress
        )
        to_prune = [n for n in to_prune if n in calibrated]
    if result.skipped:
        names_skipped = ", ".join(n for n, _ in result.skipped)
        log.warning("skipped %d tensors that cannot take %s: %s", len(result.skipped), pat, names_skipped)

    prune_set = set(to_prune)

    def process(name: str) -> torch.Tensor:
        if name not in prune_set:
            return ckpt.get(name)
        tensor = ckpt.get(name)
        pruned = calibrated.pop(name) if name in calibrated else prune_tensor(tensor, pat, target, method)
        zeros = int((pruned == 0).sum())
        result.pruned.append(PrunedTensor(name, tuple(tensor.shape), str(pat), zeros / pruned.numel(), target, method))
        return pruned

    write_checkpoint(ckpt, output, process, result, overwrite, progress)
    return result
