"""Sensitivity analysis: prune one layer group at a time over a sparsity sweep and measure the damage.

Layer groups are the prunable tensors with their layer index replaced by ``*`` (e.g.
``encoder.layer.*.intermediate.dense.weight``): the same role in every block. For each group
and each sparsity, the group alone is pruned (magnitude, Wanda or SparseGPT, with statistics
from the dense model on calibration text), the model runs on held-out text, and the output
error is recorded:

- sentence-transformers models: ``1 - cosine`` between pruned and dense sentence embeddings,
  averaged over texts;
- other models: relative L2 error ``||y - y_dense|| / ||y_dense||`` of the first output
  (last hidden state or logits) over real tokens.

``allocate`` turns the curves into per-group sparsities with a given parameter-weighted mean:
a greedy allocation in steps of 1% that always prunes where the (linearly interpolated) error
grows least per pruned parameter, assuming errors of different groups add up (the assumption
behind OWL-style non-uniform sparsity, Yin et al. 2024, and Han et al. 2015's per-layer
sensitivity sweeps).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..errors import PatternError, PrunekitError
from ..io import open_checkpoint
from .calibration import LayerStats, _collect, build_hf_model, linear_weight_names, tokenize
from .criteria import check_method, magnitude, method_mask, wanda
from .patterns import NM, Pattern, parse_pattern
from .select import select_tensors
from .sparsegpt import sparsegpt_prune

__all__ = ["GroupSensitivity", "Sensitivity", "layer_groups", "analyze_checkpoint", "allocate_sparsity", "save_plot"]

log = logging.getLogger(__name__)
Progress = Callable[[int, int, str], None]
ALLOCATION_STEP = 0.01
_INDEX_RE = re.compile(r"\.\d+\.")


@dataclass
class GroupSensitivity:
    """One layer group: its tensors, parameter count, and output error at each swept sparsity."""

    name: str
    tensors: list[str]
    params: int
    errors: list[float] = field(default_factory=list)


@dataclass
class Sensitivity:
    """Result of :func:`analyze_checkpoint`; ``allocation`` maps group name -> sparsity when asked for."""

    checkpoint: str
    pattern: str
    method: str
    metric: str
    sparsities: list[float]
    groups: list[GroupSensitivity]
    texts: int
    allocation: dict[str, float] | None = None
    allocated_mean: float | None = None
    elapsed_s: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def layer_groups(names: list[str]) -> dict[str, list[str]]:
    """Group tensor names by role: ``a.3.b.weight`` -> ``a.*.b.weight`` (order of first appearance)."""
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(_INDEX_RE.sub(".*.", name), []).append(name)
    return groups


def _interp(sparsities: list[float], errors: list[float], s: float) -> float:
    xs, ys = [0.0, *sparsities], [0.0, *errors]
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x0 <= s <= x1:
            return y0 + (y1 - y0) * (s - x0) / (x1 - x0) if x1 > x0 else y1
    return ys[-1]


def allocate_sparsity(groups: list[GroupSensitivity], sparsities: list[float], target: float) -> dict[str, float]:
    """Per-group sparsities (multiples of 1%) whose parameter-weighted mean reaches ``target``.

    Greedy: repeatedly raise by 1% the group whose interpolated error grows least per pruned
    parameter. Errors of groups are assumed additive.

    Raises:
        PatternError: target outside [0, max swept sparsity].
    """
    top = max(sparsities)
    if not 0.0 <= target <= top:
        raise PatternError(f"--allocate {target} must be in [0, {top:g}] (the largest swept sparsity)")
    total = sum(g.params for g in groups)
    level = {g.name: 0 for g in groups}
    steps_max = round(top / ALLOCATION_STEP)
    pruned = 0.0
    while pruned / total < target - 1e-9:
        best, best_cost = None, None
        for g in groups:
            k = level[g.name]
            if k >= steps_max:
                continue
            s0, s1 = k * ALLOCATION_STEP, (k + 1) * ALLOCATION_STEP
            cost = (_interp(sparsities, g.errors, s1) - _interp(sparsities, g.errors, s0)) / (
                g.params * ALLOCATION_STEP
            )
            if best_cost is None or cost < best_cost:
                best, best_cost = g, cost
        if best is None:
            break
        level[best.name] += 1
        pruned += best.params * ALLOCATION_STEP
    return {name: round(k * ALLOCATION_STEP, 4) for name, k in level.items()}


class _Evaluator:
    """Runs the model on held-out batches and measures the error against the dense outputs."""

    def __init__(self, model: nn.Module, config_dir: Path, batches: list[dict]):
        from ..deploy.runtime.loader import _pooling

        self.model, self.batches = model, batches
        self.mode, self.normalize = _pooling(config_dir)
        self.metric = "1 - cosine of sentence embeddings" if self.mode else "relative L2 error of the first output"
        self.reference = self._outputs()

    @torch.no_grad()
    def _outputs(self) -> list[torch.Tensor]:
        from ..deploy.runtime.loader import pool

        outs = []
        for batch in self.batches:
            first = self.model(**batch)[0].float()
            outs.append(pool(first, batch["attention_mask"], self.mode, self.normalize) if self.mode else first)
        return outs

    def error(self) -> float:
        outs = self._outputs()
        if self.mode:
            cos = torch.cat([torch.nn.functional.cosine_similarity(a, b, dim=-1) for a, b in zip(outs, self.reference)])
            return float(1.0 - cos.mean())
        num = den = 0.0
        for a, b, batch in zip(outs, self.reference, self.batches):
            mask = batch["attention_mask"].unsqueeze(-1).to(a.dtype) if a.dim() == 3 else 1.0
            num += float((((a - b) ** 2) * mask).sum())
            den += float(((b**2) * mask).sum())
        return (num / den) ** 0.5 if den else 0.0


def analyze_checkpoint(
    checkpoint: str | Path,
    pattern: str | Pattern,
    sparsities: list[float],
    method: str = "magnitude",
    data: str | Path | None = None,
    samples: int = 64,
    allocate: float | None = None,
    calib_samples: int = 64,
    max_length: int = 128,
    progress: Progress | None = None,
) -> Sensitivity:
    """Sweep sparsity per layer group of an HF model and measure the output error on held-out text.

    Args:
        checkpoint: Hugging Face model directory.
        pattern: ``unstructured`` | ``block:RxC`` | ``N:M`` (N:M sweeps only its implied sparsity).
        sparsities: fractions of zeros in [0, 1).
        method: ``magnitude`` | ``wanda`` | ``sparsegpt`` (statistics from the dense model).
        data: held-out text file (lines / JSON lines); default: the stdlib corpus' held-out split.
        samples: number of held-out texts. calib_samples: calibration texts for Wanda/SparseGPT.
        allocate: derive per-group sparsities with this parameter-weighted mean.
        progress: ``(done, total, group)`` after each measurement.

    Raises:
        PrunekitError: not an HF directory. PatternError: bad pattern/sparsity/method, nothing to
        analyze, an allocation target out of range or with N:M. DataError: bad text file.
    """
    from ..data import calibration_texts, evaluation_texts, load_texts

    started = time.perf_counter()
    checkpoint = Path(checkpoint)
    pat = parse_pattern(pattern) if isinstance(pattern, str) else pattern
    check_method(method)
    if isinstance(pat, NM):
        sparsities = [pat.check_sparsity(None)]
        if allocate is not None:
            raise PatternError(f"--allocate needs a pattern with a free sparsity, not {pat}")
    if not sparsities:
        raise PatternError("give at least one sparsity to sweep")
    sparsities = sorted({pat.check_sparsity(s) for s in sparsities})
    ckpt = open_checkpoint(checkpoint)
    if ckpt.kind != "hf":
        raise PrunekitError(
            f"analyze needs a Hugging Face model directory (it runs the model); {checkpoint} is a {ckpt.kind} checkpoint"
        )
    model = build_hf_model(checkpoint)
    linear_of = linear_weight_names(model)
    names = ckpt.names()
    selection = select_tensors([(n, len(ckpt.shape(n)), ckpt.is_floating(n)) for n in names])
    usable = [n for n in selection.selected if n in linear_of and pat.unfit_reason(tuple(ckpt.shape(n))) is None]
    if not usable:
        raise PatternError(f"nothing to analyze in {checkpoint}: no linear weight fits {pat}")
    modules = dict(model.named_modules())
    texts = load_texts(data, limit=samples) if data is not None else evaluation_texts(samples)
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    limit = getattr(tokenizer, "model_max_length", max_length) or max_length
    length = min(max_length, limit)
    batches = [
        dict(tokenizer(texts[i : i + 16], padding=True, truncation=True, max_length=length, return_tensors="pt"))
        for i in range(0, len(texts), 16)
    ]
    evaluator = _Evaluator(model, checkpoint, batches)
    stats: dict[str, LayerStats] = {}
    if method != "magnitude":
        targets = {linear_of[n]: modules[linear_of[n]] for n in usable}
        current: dict = {"mask": None}
        stats, handles = _collect(targets, method == "sparsegpt", current)
        with torch.no_grad():
            for batch in tokenize(checkpoint, calibration_texts(calib_samples), max_length):
                current["mask"] = batch["attention_mask"].bool()
                model(**batch)
        for h in handles:
            h.remove()

    groups = [
        GroupSensitivity(g, tensors, sum(modules[linear_of[t]].weight.numel() for t in tensors))
        for g, tensors in layer_groups(usable).items()
    ]
    total, done = len(groups) * len(sparsities), 0
    for group in groups:
        originals = {t: modules[linear_of[t]].weight.detach().clone() for t in group.tensors}
        for s in sparsities:
            with torch.no_grad():
                for t in group.tensors:
                    module = modules[linear_of[t]]
                    module.weight.copy_(_pruned(originals[t], stats.get(linear_of[t]), pat, s, method))
            group.errors.append(evaluator.error())
            done += 1
            if progress:
                progress(done, total, group.name)
        with torch.no_grad():
            for t in group.tensors:
                modules[linear_of[t]].weight.copy_(originals[t])
    result = Sensitivity(str(checkpoint), str(pat), method, evaluator.metric, sparsities, groups, len(texts))
    if allocate is not None:
        result.allocation = allocate_sparsity(groups, sparsities, allocate)
        result.allocated_mean = sum(result.allocation[g.name] * g.params for g in groups) / sum(
            g.params for g in groups
        )
    result.elapsed_s = time.perf_counter() - started
    return result


def _pruned(weight: torch.Tensor, stats: LayerStats | None, pattern: Pattern, sparsity: float, method: str):
    if method == "sparsegpt":
        return sparsegpt_prune(weight, stats.hessian / max(stats.tokens, 1), pattern, sparsity)[0]
    scores = wanda(weight, stats.input_norm) if method == "wanda" else magnitude(weight)
    return weight * method_mask(scores, pattern, sparsity, rowwise=method == "wanda").to(weight.dtype)


def save_plot(result: Sensitivity, path: str | Path) -> None:
    """PNG: output error vs sparsity, one line per layer group (log-scale error)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for group in result.groups:
        ax.plot(result.sparsities, [max(e, 1e-8) for e in group.errors], marker="o", label=group.name)
    ax.set_xlabel(f"sparsity ({result.pattern}, {result.method})")
    ax.set_ylabel(result.metric)
    ax.set_yscale("log")
    ax.set_title(f"sensitivity of {Path(result.checkpoint).name}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)
