"""Fine-tuning a pruned model with exact masks: one-shot or gradual pruning, distillation, resumable.

- Schedules: ``oneshot`` prunes once before training (magnitude, Wanda or SparseGPT); ``gmp``
  raises sparsity on the cubic schedule of Zhu & Gupta 2017 ("To prune, or not to prune", eq. 1),
  recomputing magnitude masks every ``frequency`` steps; pruned weights stay pruned (they score
  below every kept weight), so masks only shrink.
- Exact masks: after every optimizer step, a pruned weight is exactly zero: its gradient is
  zeroed before the step and the mask is re-applied after it (AdamW's momentum and weight decay
  would otherwise move it).
- Distillation from the dense teacher (Hinton et al. 2015): ``cosine`` or ``mse`` on pooled
  sentence embeddings (sentence-transformers pooling from the model directory, mean pooling
  otherwise), ``kl`` on logits at a temperature (scaled by T^2); optional MSE on the last hidden
  states.
- Resumable: every ``checkpoint_every`` steps, model, optimizer, LR scheduler, step, masks and RNG
  states are written atomically to ``OUTPUT.state/state.pt``; ``resume=True`` continues from
  there. Batches are a pure function of (seed, step), so a resumed run is bit-identical to an
  uninterrupted one on the CPU.
- AMP (bfloat16 autocast) on CUDA. Several GPUs: launch with ``torchrun --nproc-per-node N``;
  each rank runs a DDP replica on its share of every batch and rank 0 writes states and output
  (this path has not been run in CI, which has no GPU).
"""

from __future__ import annotations

import logging
import math
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import PatternError, PrunekitError
from ..io import atomic_path, check_output, open_checkpoint
from ..recipes import Recipe, gmp_sparsity, load_recipe
from . import PrunedTensor, PruneResult, fit_targets, write_checkpoint
from .calibration import build_hf_model, linear_weight_names, prune_model, tokenize
from .criteria import magnitude
from .patterns import Pattern
from .select import select_tensors

__all__ = ["FinetuneResult", "finetune_checkpoint", "state_path", "recipe_targets"]

log = logging.getLogger(__name__)
StepProgress = Callable[[int, int, float], None]
STATE_FILE = "state.pt"


@dataclass
class FinetuneResult:
    """What :func:`finetune_checkpoint` did.

    Attributes:
        losses: training loss per step run in this call (float, the recipe's loss).
        resumed_from: the step the run resumed from, or None.
    """

    output: Path
    steps: int
    losses: list[float] = field(default_factory=list)
    pruned: list[PrunedTensor] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    resumed_from: int | None = None
    elapsed_s: float = 0.0


def state_path(output: str | Path) -> Path:
    """Where the resumable training state of ``output`` lives: ``OUTPUT.state/state.pt``."""
    output = Path(output)
    return output.with_name(output.name + ".state") / STATE_FILE


def recipe_targets(ckpt, recipe: Recipe, result: PruneResult) -> dict[str, tuple[Pattern, float]]:
    """Tensor name -> (pattern, final sparsity) for every default-prunable tensor a recipe target matches.

    The first matching target wins; tensors whose shape cannot take the pattern are skipped.

    Raises:
        PatternError: a bad exclude regex, or no tensor matched.
    """
    names = ckpt.names()
    selection = select_tensors(
        [(n, len(ckpt.shape(n)), ckpt.is_floating(n)) for n in names], None, recipe.prune.exclude
    )
    assigned: dict[str, tuple[Pattern, float]] = {}
    for target in recipe.prune.targets:
        regex = re.compile(target.regex)
        matched = [n for n in selection.selected if regex.search(n) and n not in assigned]
        for name in fit_targets(ckpt, matched, set(), target.parsed, result):
            assigned[name] = (target.parsed, target.final_sparsity)
    if not assigned:
        raise PatternError(f"recipe {recipe.name}: no tensor of {ckpt.path} matches a target and fits its pattern")
    return assigned


def _lr_lambda(recipe: Recipe, steps: int) -> Callable[[int], float]:
    sched = recipe.finetune.lr_schedule
    warmup = sched.warmup_steps

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if sched.name == "constant" or steps <= warmup:
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, steps - warmup))
        return 1.0 - progress if sched.name == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def _batch_indices(step: int, batch_size: int, n_texts: int, seed: int) -> list[int]:
    """Indices of the texts of ``step``: consecutive slices of per-epoch permutations (pure function of step)."""
    out = []
    for pos in range(step * batch_size, (step + 1) * batch_size):
        epoch, i = divmod(pos, n_texts)
        perm = torch.randperm(n_texts, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        out.append(int(perm[i]))
    return out


class _Loss:
    """The recipe's training loss on one batch (distillation, or the model's own LM loss)."""

    def __init__(self, recipe: Recipe, student: nn.Module, teacher: nn.Module | None, config_dir: Path):
        from ..deploy.runtime.loader import _pooling

        self.dist = recipe.distillation
        self.teacher = teacher
        mode, normalize = _pooling(config_dir)
        self.pool_mode = mode or "mean"
        self.normalize = normalize
        if self.dist is None and not hasattr(student, "lm_head") and "ForCausalLM" not in type(student).__name__:
            raise PrunekitError(
                f"recipe {recipe.name} has no distillation and {type(student).__name__} has no loss on plain text; "
                "add a distillation section"
            )

    def __call__(self, student: nn.Module, batch: dict) -> torch.Tensor:
        from ..deploy.runtime.loader import pool

        if self.dist is None:
            return student(**batch, labels=batch["input_ids"]).loss
        extra = {"output_hidden_states": True} if self.dist.hidden_mse_weight > 0 else {}
        out = student(**batch, **extra)
        with torch.no_grad():
            ref = self.teacher(**batch, **extra)
        mask = batch["attention_mask"]
        loss = torch.zeros((), device=mask.device)
        has_logits = getattr(out, "logits", None) is not None
        if self.dist.loss == "kl":
            if not has_logits:
                raise PrunekitError(
                    "distillation loss 'kl' needs a model with logits; use cosine or mse for embeddings"
                )
            t = self.dist.temperature
            log_p = F.log_softmax(out.logits.float() / t, dim=-1)
            log_q = F.log_softmax(ref.logits.float() / t, dim=-1)
            kl = (log_q.exp() * (log_q - log_p)).sum(dim=-1)
            if kl.dim() == 2:  # (batch, tokens): average over real tokens
                kl = (kl * mask).sum() / mask.sum()
            loss = loss + self.dist.weight * kl.mean() * t * t
        else:
            hidden, ref_hidden = out.last_hidden_state.float(), ref.last_hidden_state.float()
            emb = pool(hidden, mask, self.pool_mode, self.normalize)
            ref_emb = pool(ref_hidden, mask, self.pool_mode, self.normalize)
            if self.dist.loss == "cosine":
                term = (1.0 - F.cosine_similarity(emb, ref_emb, dim=-1)).mean()
            else:
                term = F.mse_loss(emb, ref_emb)
            loss = loss + self.dist.weight * term
        if self.dist.hidden_mse_weight > 0:
            hidden = out.hidden_states[-1] if out.hidden_states is not None else out.last_hidden_state
            ref_hidden = ref.hidden_states[-1] if ref.hidden_states is not None else ref.last_hidden_state
            sq = ((hidden.float() - ref_hidden.float()) ** 2).mean(dim=-1)
            loss = loss + self.dist.hidden_mse_weight * (sq * mask).sum() / mask.sum()
        return loss


def _gmp_masks(modules: dict[str, nn.Linear], specs: dict[str, tuple[Pattern, float]], masks, sparsity_of) -> None:
    """Recompute magnitude masks at the scheduled sparsity; already-pruned weights stay pruned."""
    with torch.no_grad():
        for name, module in modules.items():
            pattern, _ = specs[name]
            scores = magnitude(module.weight)
            old = masks.get(name)
            if old is not None:
                scores = torch.where(old.to(scores.device), scores, torch.full_like(scores, -1.0))
            keep = pattern.mask(scores, sparsity_of(name))
            masks[name] = keep
            module.weight.mul_(keep.to(module.weight.dtype))


def _rng_state(device: torch.device) -> dict:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def finetune_checkpoint(
    checkpoint: str | Path,
    recipe: str | Path | Recipe,
    output: str | Path,
    data: str | Path | list[str] | None = None,
    resume: bool = False,
    overwrite: bool = False,
    steps: int | None = None,
    teacher: str | Path | None = None,
    device: str | None = None,
    progress: StepProgress | None = None,
) -> FinetuneResult:
    """Prune an HF checkpoint by a recipe, fine-tune it with exact masks, and write it like ``prune``.

    Args:
        checkpoint: Hugging Face model directory (dense, or already pruned by ``prunekit prune``).
        recipe: shipped recipe name, recipe file, or :class:`Recipe`.
        output: output directory (HF), with ``prunekit.json`` (method e.g. ``gmp+distill``).
        data: training text file (lines or JSON lines with ``text``) or texts, also the calibration
            text of a one-shot Wanda/SparseGPT recipe; default: the calibration split of the stdlib
            docstring corpus (never its held-out split).
        resume: continue from ``OUTPUT.state/state.pt`` when it exists (else start afresh).
        steps: override ``finetune.steps``; the GMP schedule, warmup and checkpoint interval are
            scaled by the same factor.
        teacher: dense teacher directory (default: the pruned checkpoint's sidecar source when it
            exists, else ``checkpoint`` itself).
        device: ``cuda`` | ``cpu`` (default: cuda when available); under torchrun, each rank's GPU.
        progress: ``(step_done, total_steps, loss)`` after every step.

    Raises:
        PrunekitError: not an HF directory, a state written for another recipe, a loss the model
            cannot produce. RecipeError: unknown/invalid recipe. DataError: bad data file.
        OutputExistsError: output exists without ``overwrite``.
    """
    import torch.distributed as dist

    from ..data import DataError, calibration_texts, load_texts

    started = time.perf_counter()
    checkpoint, output = Path(checkpoint), Path(output)
    recipe = recipe if isinstance(recipe, Recipe) else load_recipe(recipe)
    if steps is not None:
        recipe = _scaled(recipe, steps)
    check_output(output, overwrite, inputs=(checkpoint,))
    ckpt = open_checkpoint(checkpoint)
    if ckpt.kind != "hf":
        raise PrunekitError(
            f"finetune needs a Hugging Face model directory (it trains the model); {checkpoint} is a {ckpt.kind} checkpoint"
        )
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if world > 1 and torch.cuda.is_available():
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(dev)
    else:
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))

    prune_record = PruneResult(output)
    tensor_specs = recipe_targets(ckpt, recipe, prune_record)
    student = build_hf_model(checkpoint)
    linear_of = linear_weight_names(student)
    specs: dict[str, tuple[Pattern, float]] = {}
    tensor_of: dict[str, str] = {}
    for name, spec in tensor_specs.items():
        if name in linear_of:
            specs[linear_of[name]] = spec
            tensor_of[linear_of[name]] = name
        else:
            prune_record.skipped.append((name, "not an nn.Linear weight"))
    modules = {n: m for n, m in student.named_modules() if n in specs}
    ft = recipe.finetune
    total = ft.steps if ft is not None else 0
    sched = recipe.prune.schedule
    texts = data if isinstance(data, list) else load_texts(data) if data is not None else calibration_texts()
    if not texts:
        raise DataError("no training texts")
    if ft is not None and world > 1 and ft.batch_size % world:
        raise PrunekitError(f"batch size {ft.batch_size} does not split over {world} processes (torchrun)")
    state_file = state_path(output)
    state = None
    if resume and state_file.is_file():
        state = torch.load(state_file, map_location="cpu", weights_only=True)
        if state.get("recipe") != recipe.model_dump(mode="json"):
            raise PrunekitError(f"{state_file} was written for another recipe (or --steps); rerun without --resume")
    elif resume:
        log.warning("nothing to resume at %s: starting from step 0", state_file)

    masks: dict[str, torch.Tensor] = {}
    if state is not None:
        student.load_state_dict(state["model"])
        masks = {n: m.bool() for n, m in state["masks"].items()}
    elif sched.kind == "oneshot":
        n_calib = recipe.prune.calibration_samples
        batches = tokenize(checkpoint, texts[:n_calib] if data is not None else calibration_texts(n_calib))
        masks = prune_model(student, specs, recipe.prune.method, batches, dev)
    student.to(dev)
    masks = {n: m.to(dev) for n, m in masks.items()}

    teacher_model = None
    if recipe.distillation is not None and total > 0:
        source = teacher
        if source is None and ckpt.sidecar is not None and Path(ckpt.sidecar["source"]["path"]).is_dir():
            source = ckpt.sidecar["source"]["path"]
        if source is None and ckpt.sidecar is not None:
            log.warning("the dense source of %s is not found: distilling from the checkpoint itself", checkpoint)
        teacher_model = build_hf_model(source or checkpoint).to(dev)
        for p in teacher_model.parameters():
            p.requires_grad_(False)
    loss_fn = _Loss(recipe, student, teacher_model, checkpoint) if total > 0 else None

    result = FinetuneResult(output, total, resumed_from=state["step"] if state else None)
    start = state["step"] if state else 0
    if total > 0:
        opt_cfg = ft.optimizer
        params = [p for p in student.parameters() if p.requires_grad]
        if opt_cfg.name == "adamw":
            optimizer = torch.optim.AdamW(params, lr=opt_cfg.lr, betas=opt_cfg.betas, weight_decay=opt_cfg.weight_decay)
        else:
            optimizer = torch.optim.SGD(
                params, lr=opt_cfg.lr, momentum=opt_cfg.momentum, weight_decay=opt_cfg.weight_decay
            )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(recipe, total))
        if state is not None:
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
            _set_rng_state(state["rng"], dev)
        else:
            torch.manual_seed(ft.seed)
        model = student
        if world > 1:
            model = nn.parallel.DistributedDataParallel(student, device_ids=[dev.index] if dev.type == "cuda" else None)
        import transformers

        tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
        max_length = min(ft.max_length, getattr(tokenizer, "model_max_length", ft.max_length) or ft.max_length)
        weight_of = {n: m.weight for n, m in modules.items()}
        student.train()
        for step in range(start, total):
            pruning_step = sched.kind == "gmp" and (
                step == sched.end_step
                or (sched.start_step <= step < sched.end_step and (step - sched.start_step) % sched.frequency == 0)
            )
            if pruning_step:
                _gmp_masks(modules, specs, masks, lambda n, step=step: gmp_sparsity(step, sched, specs[n][1]))
            indices = _batch_indices(step, ft.batch_size, len(texts), ft.seed)[rank::world]
            batch = tokenizer(
                [texts[i] for i in indices], padding=True, truncation=True, max_length=max_length, return_tensors="pt"
            )
            batch = {k: v.to(dev) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dev.type == "cuda"):
                loss = loss_fn(model, batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            with torch.no_grad():
                for name, weight in weight_of.items():
                    if name in masks and weight.grad is not None:
                        weight.grad.mul_(masks[name].to(weight.grad.dtype))
            if ft.grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(params, ft.grad_clip)
            optimizer.step()
            scheduler.step()
            with torch.no_grad():
                for name, weight in weight_of.items():
                    if name in masks:
                        weight.mul_(masks[name].to(weight.dtype))
            value = float(loss.detach())
            if world > 1:
                reduced = torch.tensor([value], device=dev)
                dist.all_reduce(reduced)
                value = float(reduced) / world
            result.losses.append(value)
            done = step + 1
            if done % ft.checkpoint_every == 0 and done < total and rank == 0:
                _save_state(state_file, recipe, done, student, optimizer, scheduler, masks, dev)
            if progress:
                progress(done, total, value)
        student.eval()
    if sched.kind == "gmp" and total <= sched.end_step:  # the final pruning step falls after the last step
        _gmp_masks(modules, specs, masks, lambda n: specs[n][1])
    if rank == 0:
        _write_output(ckpt, output, overwrite, student, specs, tensor_of, masks, recipe, prune_record, result)
        if state_file.parent.is_dir():
            shutil.rmtree(state_file.parent)
    if world > 1:
        dist.barrier()
    result.elapsed_s = time.perf_counter() - started
    return result


def _scaled(recipe: Recipe, steps: int) -> Recipe:
    """The recipe with ``finetune.steps = steps`` and every step count scaled by the same factor."""
    if recipe.finetune is None:
        if steps:
            raise PrunekitError(f"recipe {recipe.name} has no finetune section: --steps does not apply")
        return recipe
    factor = steps / recipe.finetune.steps if recipe.finetune.steps else 0.0
    sched = recipe.prune.schedule
    data = recipe.model_dump()
    data["finetune"]["steps"] = steps
    data["finetune"]["checkpoint_every"] = max(1, round(recipe.finetune.checkpoint_every * factor))
    data["finetune"]["lr_schedule"]["warmup_steps"] = round(recipe.finetune.lr_schedule.warmup_steps * factor)
    if sched.kind == "gmp":
        start, end = round(sched.start_step * factor), max(1, round(sched.end_step * factor))
        data["prune"]["schedule"].update(
            start_step=start, end_step=max(end, start + 1), frequency=max(1, round(sched.frequency * factor))
        )
    return Recipe.model_validate(data)


def _save_state(path: Path, recipe, step, student, optimizer, scheduler, masks, dev) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {
        "recipe": recipe.model_dump(mode="json"),
        "step": step,
        "model": {k: v.detach().cpu() for k, v in student.state_dict().items()},
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "masks": {n: m.cpu() for n, m in masks.items()},
        "rng": _rng_state(dev),
    }
    with atomic_path(path, overwrite=True) as tmp:
        torch.save(state, tmp)


def _write_output(ckpt, output, overwrite, student, specs, tensor_of, masks, recipe, record, result) -> None:
    modules = dict(student.named_modules())
    state = student.state_dict()
    prefix = getattr(student, "base_model_prefix", "") or ""
    pruned_tensor = {tensor_of[n]: n for n in specs}
    label = recipe.method_label

    def tensor(name: str) -> torch.Tensor:
        source = ckpt.get(name)
        module_name = pruned_tensor.get(name)
        if module_name is not None:
            pattern, sparsity = specs[module_name]
            weight = modules[module_name].weight.detach().cpu()
            keep = masks[module_name].cpu() if module_name in masks else torch.ones_like(weight, dtype=torch.bool)
            if not pattern.is_valid(keep) or not bool((weight[~keep] == 0).all()):
                raise PrunekitError(f"{name}: mask lost during training (a bug)")
            out = weight.to(source.dtype).reshape(source.shape)
            zeros = int((out == 0).sum())
            record.pruned.append(
                PrunedTensor(name, tuple(source.shape), str(pattern), zeros / out.numel(), sparsity, label)
            )
            return out
        for key in (name, f"{prefix}.{name}", name.removeprefix(prefix + ".")):
            if key in state and state[key].shape == source.shape:
                return state[key].detach().cpu().to(source.dtype)
        return source

    write_checkpoint(ckpt, output, tensor, record, overwrite)
    result.pruned, result.skipped = record.pruned, record.skipped
