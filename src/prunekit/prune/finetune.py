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
- Mixed precision (Micikevicius et al. 2018): ``finetune.precision`` ``auto`` autocasts to
  bfloat16 on CUDA (float32 on the CPU); ``fp16`` adds dynamic loss scaling (``GradScaler``).
  Weights, optimizer state and masks stay float32; masks are re-applied to the float32 weights
  after every step.
- Several processes (PyTorch DDP, Li et al. 2020, "PyTorch Distributed"): launched by
  ``torchrun --nproc-per-node N``, each rank takes the GPU ``LOCAL_RANK`` (or the CPU with gloo),
  trains a DistributedDataParallel replica on a disjoint, deterministic share of every global
  batch (rank r takes texts r, r + N, ... of it), recomputes the GMP masks like every other rank
  and takes rank 0's masks (broadcast), and checks at the end that every replica holds the same
  weights and masks. Rank 0 alone writes training states and the output; ``resume`` works the
  same, each rank restoring its own RNG state. CI runs this path on the CPU (gloo, 2 processes);
  NCCL on several GPUs has not been run yet.
"""

from __future__ import annotations

import hashlib
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

__all__ = ["FinetuneResult", "finetune_checkpoint", "state_path", "recipe_targets", "rank_share"]

log = logging.getLogger(__name__)
StepProgress = Callable[[int, int, float], None]
STATE_FILE = "state.pt"


@dataclass
class FinetuneResult:
    """What :func:`finetune_checkpoint` did.

    Attributes:
        losses: training loss per step run in this call (float, the recipe's loss).
        resumed_from: the step the run resumed from, or None.
        pruned, skipped: what the output holds (filled on rank 0, the rank that writes it).
        rank, world_size: this process' rank and the number of processes (0 and 1 without torchrun).
        precision: the autocast dtype used (``bf16`` | ``fp16``), or ``fp32`` without autocast.
        replica_digest: sha256 of this rank's trained weights and masks after the last step, set
            under torchrun only (equal on every rank, or the run raises).
    """

    output: Path
    steps: int
    losses: list[float] = field(default_factory=list)
    pruned: list[PrunedTensor] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    resumed_from: int | None = None
    elapsed_s: float = 0.0
    rank: int = 0
    world_size: int = 1
    precision: str = "fp32"
    replica_digest: str | None = None


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
    perms: dict[int, torch.Tensor] = {}
    for pos in range(step * batch_size, (step + 1) * batch_size):
        epoch, i = divmod(pos, n_texts)
        if epoch not in perms:
            perms[epoch] = torch.randperm(n_texts, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        out.append(int(perms[epoch][i]))
    return out


def rank_share(indices: list[int], rank: int, world_size: int) -> list[int]:
    """The texts of a global batch that one DDP rank trains on: positions ``rank, rank + world_size, ...``.

    The shares of all ranks are disjoint and together are the whole batch (when ``world_size``
    divides its length, every share has the same size, so DDP's mean of per-rank gradients is the
    gradient of the batch-mean loss).
    """
    return indices[rank::world_size]


def _amp_dtype(precision: str, dev: torch.device) -> torch.dtype | None:
    """The autocast dtype of a recipe's ``precision`` on ``dev`` (None: no autocast, float32).

    Raises:
        PrunekitError: ``bf16`` on a GPU without bfloat16 support.
    """
    dtype = {"auto": torch.bfloat16 if dev.type == "cuda" else None, "bf16": torch.bfloat16, "fp16": torch.float16}
    amp = dtype.get(precision)
    if amp is torch.bfloat16 and dev.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise PrunekitError(f"{torch.cuda.get_device_name(dev)} has no bfloat16: use --precision fp16 or fp32")
    return amp


@dataclass(frozen=True)
class _Ranks:
    """This process' place among the DDP processes (rank 0 of 1 without torchrun)."""

    rank: int = 0
    world_size: int = 1
    owns_group: bool = False  # this call initialised the process group, so it destroys it


def _setup_distributed(device: str | None) -> tuple[torch.device, _Ranks]:
    """Pick the device and, under torchrun (``WORLD_SIZE`` > 1), join the process group.

    Each rank takes GPU ``LOCAL_RANK`` (nccl), or the CPU when ``device`` is ``cpu`` or there is
    no GPU (gloo). A process group initialised by the caller is used as it is.

    Raises:
        PrunekitError: ``device`` is cuda without a GPU, or a rank has no GPU of its own.
    """
    import torch.distributed as dist

    wanted = torch.device(device) if device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if wanted.type == "cuda" and not torch.cuda.is_available():
        raise PrunekitError("--device cuda, but torch sees no GPU")
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return wanted, _Ranks()
    if wanted.type == "cuda":
        fallback = dist.get_rank() % max(1, torch.cuda.device_count()) if dist.is_initialized() else 0
        local_rank = int(os.environ.get("LOCAL_RANK", fallback))
        if local_rank >= torch.cuda.device_count():
            raise PrunekitError(
                f"LOCAL_RANK {local_rank} but {torch.cuda.device_count()} GPU(s): start at most one process per GPU"
            )
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    owns = False
    if not dist.is_initialized():
        if dev.type == "cuda":
            dist.init_process_group("nccl", device_id=dev)
        else:
            dist.init_process_group("gloo")
        owns = True
    return dev, _Ranks(dist.get_rank(), dist.get_world_size(), owns)


def _broadcast_masks(masks: dict[str, torch.Tensor], dev: torch.device) -> None:
    """Replace every rank's masks by rank 0's (same keys on every rank; sent as uint8)."""
    import torch.distributed as dist

    for name in sorted(masks):
        buf = masks[name].to(device=dev, dtype=torch.uint8).contiguous()
        dist.broadcast(buf, src=0)
        masks[name] = buf.bool()


def _apply_masks(modules: dict[str, nn.Linear], masks: dict[str, torch.Tensor]) -> None:
    """Zero every pruned weight (in the weight's own dtype, float32 during training)."""
    with torch.no_grad():
        for name, module in modules.items():
            if name in masks:
                module.weight.mul_(masks[name].to(module.weight.dtype))


def _replica_digest(student: nn.Module, masks: dict[str, torch.Tensor]) -> str:
    """sha256 of every tensor of the student's state dict and of every mask (names included)."""
    digest = hashlib.sha256()
    tensors = {
        **{f"model:{k}": v for k, v in student.state_dict().items()},
        **{f"mask:{k}": v for k, v in masks.items()},
    }
    for name in sorted(tensors):
        value = tensors[name].detach().cpu().contiguous()
        digest.update(name.encode())
        digest.update(str(value.dtype).encode())
        digest.update(value.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


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
    precision: str | None = None,
) -> FinetuneResult:
    """Prune an HF checkpoint by a recipe, fine-tune it with exact masks, and write it like ``prune``.

    Under torchrun (``WORLD_SIZE`` > 1) every rank calls this function with the same arguments:
    each trains a DDP replica on its share of every batch (see :func:`rank_share`); rank 0 writes
    the training states and the output.

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
        device: ``cuda`` | ``cpu`` (default: cuda when available); under torchrun, each rank's GPU
            ``LOCAL_RANK`` (nccl), or the CPU (gloo) when ``cpu`` or without GPUs.
        progress: ``(step_done, total_steps, loss)`` after every step, on every rank (the loss is
            the mean over ranks); the CLI shows it on rank 0 only.
        precision: override ``finetune.precision`` (``auto`` | ``bf16`` | ``fp16`` | ``fp32``).

    Raises:
        PrunekitError: not an HF directory, a state written for another recipe, a loss the model
            cannot produce, a batch size that the processes cannot split evenly, DDP replicas that
            diverged. RecipeError: unknown/invalid recipe. DataError: bad data file.
        OutputExistsError: output exists without ``overwrite``.
    """
    started = time.perf_counter()
    checkpoint, output = Path(checkpoint), Path(output)
    recipe = recipe if isinstance(recipe, Recipe) else load_recipe(recipe)
    if steps is not None:
        recipe = _scaled(recipe, steps)
    if precision is not None:
        recipe = _with_precision(recipe, precision)
    check_output(output, overwrite, inputs=(checkpoint,))
    ckpt = open_checkpoint(checkpoint)
    if ckpt.kind != "hf":
        raise PrunekitError(
            f"finetune needs a Hugging Face model directory (it trains the model); {checkpoint} is a {ckpt.kind} checkpoint"
        )
    dev, ranks = _setup_distributed(device)
    try:
        return _finetune(
            ckpt, checkpoint, recipe, output, data, resume, overwrite, teacher, dev, ranks, progress, started
        )
    finally:
        if ranks.owns_group:
            import torch.distributed as dist

            dist.destroy_process_group()


def _finetune(
    ckpt, checkpoint, recipe, output, data, resume, overwrite, teacher, dev, ranks, progress, started
) -> FinetuneResult:
    """The body of :func:`finetune_checkpoint` once the device and the process group are set up."""
    import torch.distributed as dist

    from ..data import DataError, calibration_texts, load_texts

    rank, world = ranks.rank, ranks.world_size
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
    amp_dtype = _amp_dtype(ft.precision, dev) if ft is not None else None
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
    if world > 1 and masks:  # rank 0's masks everywhere (DDP broadcasts rank 0's weights below)
        _broadcast_masks(masks, dev)
        _apply_masks(modules, masks)

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

    result = FinetuneResult(
        output,
        total,
        resumed_from=state["step"] if state else None,
        rank=rank,
        world_size=world,
        precision={torch.bfloat16: "bf16", torch.float16: "fp16"}.get(amp_dtype, "fp32"),
    )
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
        # fp16 needs loss scaling (its gradients underflow); bf16 has float32's exponent range and does not.
        scaler = torch.amp.GradScaler(dev.type) if amp_dtype is torch.float16 else None
        if state is not None:
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
            if scaler is not None and state.get("scaler"):
                scaler.load_state_dict(state["scaler"])
            _set_rng_state(_rank_rng(state, rank, world), dev)
        else:
            torch.manual_seed(ft.seed + rank)  # rank 0 draws what a single process draws
        model = student
        if world > 1:
            # Parameters outside the loss (e.g. BERT's pooler) get no gradient; without find_unused_parameters
            # DDP fails on the second step. (Its warning that it found no unused parameter is wrong here.)
            model = nn.parallel.DistributedDataParallel(
                student, device_ids=[dev.index] if dev.type == "cuda" else None, find_unused_parameters=True
            )
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
                if world > 1:
                    _broadcast_masks(masks, dev)
                    _apply_masks(modules, masks)
            indices = rank_share(_batch_indices(step, ft.batch_size, len(texts), ft.seed), rank, world)
            batch = tokenizer(
                [texts[i] for i in indices], padding=True, truncation=True, max_length=max_length, return_tensors="pt"
            )
            batch = {k: v.to(dev) for k, v in batch.items()}
            with torch.autocast(dev.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                loss = loss_fn(model, batch)
            optimizer.zero_grad(set_to_none=True)
            (scaler.scale(loss) if scaler is not None else loss).backward()
            with torch.no_grad():
                for name, weight in weight_of.items():
                    if name in masks and weight.grad is not None:
                        weight.grad.mul_(masks[name].to(weight.grad.dtype))
            if scaler is not None:
                scaler.unscale_(optimizer)  # clip the true gradients
            if ft.grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(params, ft.grad_clip)
            if scaler is not None:
                scaler.step(optimizer)  # skipped when a gradient is inf/NaN (same decision on every rank)
                scaler.update()
            else:
                optimizer.step()
            scheduler.step()
            _apply_masks(modules, masks)  # float32 weights: AdamW's momentum/decay must not revive them
            value = float(loss.detach())
            if world > 1:
                reduced = torch.tensor([value], dtype=torch.float64, device=dev)
                dist.all_reduce(reduced)
                value = float(reduced) / world
            result.losses.append(value)
            done = step + 1
            if done % ft.checkpoint_every == 0 and done < total:
                rngs = _gather_rng(dev, world)
                if rank == 0:
                    _save_state(state_file, recipe, done, student, optimizer, scheduler, scaler, masks, rngs)
            if progress:
                progress(done, total, value)
        student.eval()
    if sched.kind == "gmp" and total <= sched.end_step:  # the final pruning step falls after the last step
        _gmp_masks(modules, specs, masks, lambda n: specs[n][1])
        if world > 1:
            _broadcast_masks(masks, dev)
            _apply_masks(modules, masks)
    if world > 1:
        result.replica_digest = _replica_digest(student, masks)
        digests: list[str | None] = [None] * world
        dist.all_gather_object(digests, result.replica_digest)
        if len(set(digests)) != 1:
            raise PrunekitError(f"DDP replicas diverged (a bug): weight digests differ across ranks {digests}")
    if rank == 0:
        _write_output(ckpt, output, overwrite, student, specs, tensor_of, masks, recipe, prune_record, result)
        if state_file.parent.is_dir():
            shutil.rmtree(state_file.parent)
    if world > 1:
        dist.barrier()  # no rank returns before the output exists
    result.elapsed_s = time.perf_counter() - started
    return result


def _rank_rng(state: dict, rank: int, world: int) -> dict:
    """This rank's RNG state from a training state (rank 0's, with a warning, if the world size changed)."""
    rngs = state["rng"] if isinstance(state["rng"], list) else [state["rng"]]
    if len(rngs) != world:
        log.warning(
            "the state was written by %d process(es), this run has %d: RNG states (dropout) are not restored "
            "rank by rank, so the run is not bit-identical to an uninterrupted one",
            len(rngs),
            world,
        )
    return rngs[rank] if len(rngs) == world else rngs[0]


def _gather_rng(dev: torch.device, world: int) -> list[dict]:
    """Every rank's RNG state, in rank order (a collective under torchrun: every rank calls it)."""
    mine = _rng_state(dev)
    if world == 1:
        return [mine]
    import torch.distributed as dist

    states: list[dict | None] = [None] * world
    dist.all_gather_object(states, mine)
    return states


def _with_precision(recipe: Recipe, precision: str) -> Recipe:
    """The recipe with ``finetune.precision`` replaced.

    Raises:
        RecipeError: an unknown precision, or a recipe without a finetune section.
    """
    from ..recipes import RecipeError

    if recipe.finetune is None:
        raise RecipeError(f"recipe {recipe.name} has no finetune section: --precision does not apply")
    data = recipe.model_dump()
    data["finetune"]["precision"] = precision
    try:
        return Recipe.model_validate(data)
    except ValueError:
        raise RecipeError(f"unknown precision {precision!r}: auto, bf16, fp16 or fp32") from None


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


def _save_state(path: Path, recipe, step, student, optimizer, scheduler, scaler, masks, rngs) -> None:
    """Write the training state atomically; ``rngs`` holds every rank's RNG state, in rank order."""
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {
        "recipe": recipe.model_dump(mode="json"),
        "step": step,
        "model": {k: v.detach().cpu() for k, v in student.state_dict().items()},
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict() if scaler is not None else None,
        "masks": {n: m.cpu() for n, m in masks.items()},
        "rng": rngs,
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
