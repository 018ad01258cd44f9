"""Model-level pruning with calibration data: Wanda and SparseGPT on a Hugging Face model.

Both methods need the inputs ``X: (tokens, in_features)`` that each ``nn.Linear`` sees on real
text. Following the reference implementations of SparseGPT (Frantar & Alistarh 2023, section 4)
and Wanda (Sun et al. 2023, section 3), the model is processed one transformer block at a time:

1. the calibration texts run through the model up to the first block, whose inputs (positional
   and keyword arguments) are cached; only the modules before the blocks are on ``device``;
2. for each block in order: move it to ``device``, run it on the cached inputs with forward
   pre-hooks on its selected linears accumulating input statistics (``sum_t x_tj^2`` for Wanda,
   ``H = X^T X`` for SparseGPT), prune those linears, run the block again so that its (pruned)
   outputs become the next block's inputs, and move it back to the CPU.

A model that does not fit on the GPU therefore still prunes: only one block is there at a time.
Linears outside the repeated blocks (rarely selected: heads and poolers are dense by default)
are handled by one more pass over the whole model. A model without a ``nn.ModuleList`` of blocks
is handled as a single block.

Calibration texts run in padded batches; padding tokens (``attention_mask == 0``) are left out of
the statistics.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..errors import PatternError, PrunekitError
from .criteria import magnitude, method_mask, wanda
from .patterns import Pattern
from .sparsegpt import sparsegpt_prune

__all__ = ["LayerStats", "build_hf_model", "tokenize", "prune_model", "linear_weight_names"]

log = logging.getLogger(__name__)
Progress = Callable[[int, int, str], None]
DEFAULT_MAX_LENGTH = 128  # tokens per calibration sequence (MiniLM was trained with 128)
CALIB_BATCH_SIZE = 16  # sequences per calibration forward pass


@dataclass
class LayerStats:
    """Input statistics of one linear layer over calibration tokens.

    Attributes:
        sq_sum: ``(in_features,)`` float32, ``sum_t x[t, j]^2`` (Wanda's squared norms).
        hessian: ``(in_features, in_features)`` float32, ``sum_t x_t x_t^T`` (SparseGPT), or None.
        tokens: number of tokens seen.
    """

    sq_sum: torch.Tensor
    hessian: torch.Tensor | None = None
    tokens: int = 0

    def add(self, x: torch.Tensor, token_mask: torch.Tensor | None = None) -> None:
        """Accumulate inputs ``x: (..., in_features)``; with ``token_mask: (batch, tokens)`` bool and
        ``x: (batch, tokens, in_features)``, only the real (unpadded) tokens count."""
        x = x.detach()
        if token_mask is not None and x.dim() == 3 and tuple(x.shape[:2]) == tuple(token_mask.shape):
            x = x[token_mask.to(x.device)]
        x = x.reshape(-1, x.shape[-1]).float()
        self.sq_sum += (x * x).sum(dim=0)
        if self.hessian is not None:
            self.hessian += x.T @ x
        self.tokens += x.shape[0]

    @property
    def input_norm(self) -> torch.Tensor:
        """``(in_features,)`` float32: ``||X_j||_2`` over all tokens."""
        return self.sq_sum.sqrt()


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    import transformers

    tf_logging = transformers.utils.logging
    level, bars = tf_logging.get_verbosity(), tf_logging.is_progress_bar_enabled()
    tf_logging.set_verbosity_error()
    tf_logging.disable_progress_bar()
    try:
        yield
    finally:
        tf_logging.set_verbosity(level)
        if bars:
            tf_logging.enable_progress_bar()


def build_hf_model(path: str | Path, dtype: torch.dtype | None = torch.float32) -> nn.Module:
    """Build a Hugging Face model from a directory with its weights, in eval mode on the CPU.

    The class is the config's first ``architectures`` entry when transformers has it, else
    ``AutoModel``.

    Raises:
        PrunekitError: transformers cannot build or load the model.
    """
    import transformers

    path = Path(path)
    try:
        with _quiet_transformers():
            config = transformers.AutoConfig.from_pretrained(path)
            arch = (getattr(config, "architectures", None) or [None])[0]
            cls = getattr(transformers, arch, None) if arch else None
            cls = cls if cls is not None and hasattr(cls, "from_pretrained") else transformers.AutoModel
            model = cls.from_pretrained(path, dtype=dtype)
    except (OSError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise PrunekitError(f"{path}: transformers cannot build the model ({first})") from None
    return model.eval()


def tokenize(
    path: str | Path, texts: list[str], max_length: int = DEFAULT_MAX_LENGTH, batch_size: int = CALIB_BATCH_SIZE
) -> list[dict]:
    """Tokenize texts into padded batches of ``batch_size`` (texts sorted by token count, so that
    batches hold texts of similar length), truncated to ``max_length`` tokens, or fewer when the
    tokenizer's ``model_max_length`` is smaller. Padded tokens are excluded from the statistics
    through each batch's ``attention_mask``.

    Raises:
        PrunekitError: no tokenizer in the directory, or no texts.
    """
    import transformers

    if not texts:
        raise PrunekitError("no calibration texts")
    try:
        with _quiet_transformers():
            tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise PrunekitError(f"{path}: no usable tokenizer for calibration text ({type(exc).__name__})") from None
    limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(limit, int) and 0 < limit < max_length:
        max_length = limit
    lengths = [len(ids) for ids in tokenizer(texts, truncation=True, max_length=max_length)["input_ids"]]
    order = sorted(range(len(texts)), key=lambda i: (lengths[i], i))
    return [
        dict(
            tokenizer(
                [texts[i] for i in order[start : start + batch_size]],
                padding=True,
                truncation=True,
                max_length=max_length,
                return_tensors="pt",
            )
        )
        for start in range(0, len(order), batch_size)
    ]


def linear_weight_names(model: nn.Module) -> dict[str, str]:
    """Map state-dict weight names to the names of the ``nn.Linear`` modules holding them.

    Both ``prefix.name.weight`` and ``name.weight`` (checkpoints saved from the base model of a
    model with a head, or the reverse) are mapped, using the model's ``base_model_prefix``.
    """
    prefix = getattr(model, "base_model_prefix", "") or ""
    names: dict[str, str] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            names[f"{name}.weight"] = name
            if prefix and name.startswith(prefix + "."):
                names.setdefault(f"{name[len(prefix) + 1 :]}.weight", name)
            elif prefix:
                names.setdefault(f"{prefix}.{name}.weight", name)
    return names


class _StopForward(Exception):
    """Raised by the capture hook once the first block's inputs are recorded."""


def _find_blocks(model: nn.Module, targets: set[str]) -> tuple[str, nn.ModuleList] | None:
    best = None
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            inside = sum(1 for t in targets if t.startswith(name + "."))
            if inside and (best is None or inside > best[0]):
                best = (inside, name, module)
    return (best[1], best[2]) if best else None


def _to(obj, device):
    if torch.is_tensor(obj):
        return obj.to(device)
    if isinstance(obj, tuple | list):
        return type(obj)(_to(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    return obj


def _move_outside(model: nn.Module, prefix: str, device: torch.device) -> None:
    """Move the parameters and buffers of every module outside ``prefix`` to ``device``."""
    for name, module in model.named_modules():
        if name == prefix or name.startswith(prefix + "."):
            continue
        for param in module.parameters(recurse=False):
            param.data = param.data.to(device)
        for key, buf in module.named_buffers(recurse=False):
            module._buffers[key] = buf.to(device)


@dataclass
class _Job:
    targets: dict[str, tuple[Pattern, float]]
    method: str
    need_hessian: bool
    masks: dict[str, torch.Tensor] = field(default_factory=dict)


def _collect(
    modules: dict[str, nn.Linear], need_hessian: bool, token_mask: dict | None = None
) -> tuple[dict[str, LayerStats], list]:
    """Forward pre-hooks accumulating :class:`LayerStats`; ``token_mask["mask"]`` is the current batch's."""
    token_mask = token_mask if token_mask is not None else {}
    stats, handles = {}, []
    for name, module in modules.items():
        k = module.in_features
        dev = module.weight.device
        st = LayerStats(torch.zeros(k, device=dev), torch.zeros(k, k, device=dev) if need_hessian else None)
        stats[name] = st
        handles.append(
            module.register_forward_pre_hook(lambda mod, args, st=st: st.add(args[0], token_mask.get("mask")))
        )
    return stats, handles


def _prune_linear(module: nn.Linear, stats: LayerStats | None, pattern: Pattern, sparsity: float, method: str):
    weight = module.weight.data
    if method == "sparsegpt":
        hessian = stats.hessian / max(stats.tokens, 1)
        pruned, keep = sparsegpt_prune(weight, hessian, pattern, sparsity)
        weight.copy_(pruned)
    else:
        scores = wanda(weight, stats.input_norm) if method == "wanda" else magnitude(weight)
        keep = method_mask(scores, pattern, sparsity, rowwise=method == "wanda")
        weight.mul_(keep.to(weight.dtype))
    return keep


def _process(modules: dict[str, nn.Linear], job: _Job, run_all: Callable[[], None], token_mask: dict) -> None:
    stats, handles = _collect(modules, job.need_hessian, token_mask)
    try:
        run_all()
    finally:
        for h in handles:
            h.remove()
    for name, module in modules.items():
        pattern, sparsity = job.targets[name]
        job.masks[name] = _prune_linear(module, stats[name], pattern, sparsity, job.method).cpu()
        del stats[name]


def _token_mask(batch: dict) -> torch.Tensor | None:
    mask = batch.get("attention_mask")
    return mask.bool() if mask is not None and mask.dim() == 2 else None


@torch.no_grad()
def prune_model(
    model: nn.Module,
    targets: dict[str, tuple[Pattern, float]],
    method: str,
    batches: list[dict],
    device: str | torch.device = "cpu",
    progress: Progress | None = None,
) -> dict[str, torch.Tensor]:
    """Prune the selected linears of ``model`` in place, block by block, with calibration inputs.

    Args:
        model: a Hugging Face (or any) ``nn.Module`` on the CPU, in eval mode.
        targets: ``nn.Linear`` module name -> (pattern, sparsity).
        method: ``wanda`` | ``sparsegpt`` | ``magnitude`` (magnitude ignores the data).
        batches: model keyword inputs (``input_ids``, ``attention_mask``...); tokens where the
            ``attention_mask`` is 0 (padding) do not enter the statistics.
        device: where each block runs (the rest of the model stays on the CPU).
        progress: ``(done, total, block_name)`` after each block.

    Returns:
        module name -> bool keep-mask ``(out_features, in_features)`` (CPU); weights are zero where
        the mask is False.

    Raises:
        PatternError: a target is not an ``nn.Linear``; errors of the methods (bad Hessian).
    """
    device = torch.device(device)
    modules = dict(model.named_modules())
    for name in targets:
        if not isinstance(modules.get(name), nn.Linear):
            raise PatternError(f"{name}: {method} needs an nn.Linear module")
    job = _Job(targets, method, need_hessian=method == "sparsegpt")
    current: dict[str, torch.Tensor | None] = {"mask": None}
    found = _find_blocks(model, set(targets))
    rest = set(targets)
    if found is not None and method != "magnitude":
        prefix, blocks = found
        cache: list[tuple[tuple, dict]] = []
        masks: list[torch.Tensor | None] = []

        def capture(module, args, kwargs):
            cache.append((_to(args, device), _to(kwargs, device)))
            masks.append(current["mask"])
            raise _StopForward

        _move_outside(model, prefix, device)
        handle = blocks[0].register_forward_pre_hook(capture, with_kwargs=True)
        try:
            for batch in batches:
                current["mask"] = _token_mask(batch)
                with contextlib.suppress(_StopForward):
                    model(**_to(batch, device))
        finally:
            handle.remove()
        if len(cache) != len(batches):
            raise PrunekitError(f"calibration: the model never called {prefix}.0 (cannot find its block inputs)")
        for index, block in enumerate(blocks):
            block_name = f"{prefix}.{index}"
            inside = {n: modules[n] for n in targets if n.startswith(block_name + ".")}
            block.to(device)
            if inside:

                def run_block(block=block):
                    for (args, kwargs), mask in zip(cache, masks):
                        current["mask"] = mask
                        block(*args, **kwargs)

                _process(inside, job, run_block, current)
                rest -= set(inside)
            for i, (args, kwargs) in enumerate(cache):
                out = block(*args, **kwargs)
                hidden = out[0] if isinstance(out, tuple | list) else out
                if args:
                    cache[i] = ((hidden, *args[1:]), kwargs)
                elif "hidden_states" in kwargs:
                    cache[i] = (args, {**kwargs, "hidden_states": hidden})
                else:
                    raise PrunekitError(f"calibration: cannot find the hidden states passed to {block_name}")
            block.to("cpu")
            if progress:
                progress(index + 1, len(blocks) + (1 if rest else 0), block_name)
        model.to("cpu")
    if rest:
        model.to(device)
        inside = {n: modules[n] for n in targets if n in rest}
        if method == "magnitude":
            for name, module in inside.items():
                job.masks[name] = _prune_linear(module, None, *targets[name], "magnitude").cpu()
        else:

            def run_model():
                for batch in batches:
                    current["mask"] = _token_mask(batch)
                    model(**_to(batch, device))

            _process(inside, job, run_model, current)
        model.to("cpu")
        if progress:
            progress(1, 1, "model")
    log.info("pruned %d linears with %s on %d calibration sequences", len(job.masks), method, len(batches))
    return job.masks
