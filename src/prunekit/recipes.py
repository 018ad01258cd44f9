"""Recipes: what to prune, how, on what schedule, and how to fine-tune and distill afterwards.

A recipe is YAML a person can read (in the spirit of llm-compressor's recipes): targets as
tensor-name regexes with a pattern and a sparsity, a method (``magnitude`` | ``wanda`` |
``sparsegpt``), a schedule (one-shot, or gradual magnitude pruning with the cubic schedule of
Zhu & Gupta, "To prune, or not to prune", 2017, eq. 1), the fine-tuning optimizer and learning
rate schedule, and distillation from the dense model (Hinton et al. 2015 for KL on logits;
cosine/MSE on pooled sentence embeddings for embedding models). The schema is validated by
pydantic; unknown keys and bad values are reported with the YAML file's line number.

Shipped recipes live in the top-level ``recipes/`` folder; ``src/prunekit/recipes`` links to it
so that the wheel carries them as package data.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import PatternError, PrunekitError
from .prune.patterns import NM, Pattern, parse_pattern

__all__ = [
    "RecipeError",
    "Target",
    "Schedule",
    "PruneSpec",
    "Optimizer",
    "LRSchedule",
    "Finetune",
    "Distillation",
    "Recipe",
    "recipes_dir",
    "list_recipes",
    "load_recipe",
    "parse_recipe",
    "gmp_sparsity",
]


class RecipeError(PrunekitError):
    """A recipe is unknown, not valid YAML, or does not follow the schema."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Target(_Strict):
    """Tensors whose name matches ``regex`` (``re.search``) get ``pattern`` at ``sparsity``.

    Only tensors prunable by default (linear/conv weights, see :mod:`prunekit.prune.select`)
    are candidates; the first target whose regex matches a tensor wins.
    """

    regex: str = ".*"
    pattern: str
    sparsity: float | None = None

    @field_validator("pattern", mode="before")
    @classmethod
    def _quoted(cls, value):
        if isinstance(value, int):
            raise ValueError(
                f'got the number {value}: quote N:M patterns, e.g. pattern: "2:4" (YAML reads an unquoted 2:4 '
                "as a base-60 number)"
            )
        return value

    @field_validator("regex")
    @classmethod
    def _regex(cls, value: str) -> str:
        try:
            re.compile(value)
        except re.error as exc:
            raise ValueError(f"invalid regex {value!r}: {exc}") from None
        return value

    @model_validator(mode="after")
    def _pattern(self) -> Target:
        try:
            parse_pattern(self.pattern).check_sparsity(self.sparsity)
        except PatternError as exc:
            raise ValueError(str(exc)) from None
        return self

    @property
    def parsed(self) -> Pattern:
        return parse_pattern(self.pattern)

    @property
    def final_sparsity(self) -> float:
        return parse_pattern(self.pattern).check_sparsity(self.sparsity)


class Schedule(_Strict):
    """``oneshot`` (prune before fine-tuning) or ``gmp`` (Zhu & Gupta 2017).

    GMP raises sparsity from ``initial_sparsity`` to the target between ``start_step`` and
    ``end_step``, pruning every ``frequency`` steps, with ``s_t = s_f + (s_i - s_f) (1 - (t - t_0) /
    (t_end - t_0))^3``; masks are recomputed by magnitude at each pruning step.
    """

    kind: Literal["oneshot", "gmp"] = "oneshot"
    start_step: int = Field(0, ge=0)
    end_step: int = Field(0, ge=0)
    frequency: int = Field(1, ge=1)
    initial_sparsity: float = Field(0.0, ge=0.0, lt=1.0)

    @model_validator(mode="after")
    def _steps(self) -> Schedule:
        if self.kind == "gmp" and self.end_step <= self.start_step:
            raise ValueError(f"gmp needs end_step > start_step (got {self.start_step} -> {self.end_step})")
        return self


class PruneSpec(_Strict):
    method: Literal["magnitude", "wanda", "sparsegpt"] = "magnitude"
    targets: list[Target] = Field(min_length=1)
    exclude: list[str] = Field(default_factory=list)
    schedule: Schedule = Field(default_factory=Schedule)
    calibration_samples: int = Field(128, ge=1)


class Optimizer(_Strict):
    name: Literal["adamw", "sgd"] = "adamw"
    lr: float = Field(5e-5, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    momentum: float = Field(0.9, ge=0)


class LRSchedule(_Strict):
    name: Literal["constant", "linear", "cosine"] = "linear"
    warmup_steps: int = Field(0, ge=0)


class Finetune(_Strict):
    """Fine-tuning: ``steps`` optimizer steps on batches of ``batch_size`` texts of at most ``max_length`` tokens.

    ``precision`` picks automatic mixed precision (Micikevicius et al. 2018, "Mixed Precision
    Training"): ``auto`` is bfloat16 autocast on CUDA and float32 on the CPU; ``bf16`` / ``fp16``
    autocast on any device (``fp16`` adds a dynamic loss scaler, ``torch.amp.GradScaler``);
    ``fp32`` turns autocast off. Weights, optimizer state and masks stay float32 in every mode.
    """

    steps: int = Field(ge=0)
    batch_size: int = Field(16, ge=1)
    max_length: int = Field(128, ge=8)
    seed: int = 0
    checkpoint_every: int = Field(100, ge=1)
    grad_clip: float | None = Field(1.0, gt=0)
    optimizer: Optimizer = Field(default_factory=Optimizer)
    lr_schedule: LRSchedule = Field(default_factory=LRSchedule)
    precision: Literal["auto", "bf16", "fp16", "fp32"] = "auto"


class Distillation(_Strict):
    """Distillation from the dense teacher.

    ``loss``: ``cosine`` (1 - cosine of pooled sentence embeddings), ``mse`` (on pooled
    embeddings), or ``kl`` (KL(teacher || student) on logits at ``temperature``, scaled by T^2;
    Hinton et al. 2015). ``hidden_mse_weight`` adds the MSE of the last hidden states.
    """

    loss: Literal["cosine", "mse", "kl"] = "cosine"
    weight: float = Field(1.0, ge=0)
    temperature: float = Field(1.0, gt=0)
    hidden_mse_weight: float = Field(0.0, ge=0)


class Recipe(_Strict):
    name: str
    description: str = ""
    prune: PruneSpec
    finetune: Finetune | None = None
    distillation: Distillation | None = None

    @model_validator(mode="after")
    def _consistent(self) -> Recipe:
        sched = self.prune.schedule
        if sched.kind == "gmp":
            if self.prune.method != "magnitude":
                raise ValueError("a gmp schedule prunes by magnitude: set prune.method to magnitude")
            if self.finetune is None or self.finetune.steps < sched.end_step:
                raise ValueError("a gmp schedule needs finetune.steps >= prune.schedule.end_step")
            for target in self.prune.targets:
                if isinstance(target.parsed, NM):
                    raise ValueError(f"gmp cannot ramp up an N:M pattern ({target.pattern}); use oneshot")
        if self.distillation is not None and self.finetune is None:
            raise ValueError("distillation needs a finetune section")
        return self

    @property
    def method_label(self) -> str:
        """Sidecar ``method``: e.g. ``wanda``, ``gmp+distill``, ``sparsegpt+finetune``."""
        base = "gmp" if self.prune.schedule.kind == "gmp" else self.prune.method
        if self.finetune is not None and self.finetune.steps > 0:
            base += "+distill" if self.distillation is not None else "+finetune"
        return base


def gmp_sparsity(step: int, schedule: Schedule, final: float) -> float:
    """Sparsity at ``step`` under the cubic schedule of Zhu & Gupta 2017 (eq. 1).

    Held at ``initial_sparsity`` before ``start_step`` and at ``final`` from ``end_step`` on;
    in between it changes only on pruning steps (``start_step + k * frequency``).
    """
    if schedule.kind == "oneshot" or step >= schedule.end_step:
        return final
    if step < schedule.start_step:
        return schedule.initial_sparsity
    t = schedule.start_step + (step - schedule.start_step) // schedule.frequency * schedule.frequency
    progress = (t - schedule.start_step) / (schedule.end_step - schedule.start_step)
    return final + (schedule.initial_sparsity - final) * (1.0 - progress) ** 3


def recipes_dir() -> Path:
    """The folder of shipped recipes (package data in a wheel, ``recipes/`` in a checkout)."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "recipes", here.parent.parent / "recipes"):
        if candidate.is_dir():
            return candidate
    return here / "recipes"


def list_recipes() -> list[Recipe]:
    """Every shipped recipe, by name."""
    return [load_recipe(path) for path in sorted(recipes_dir().glob("*.yaml"))]


def _line_map(text: str) -> dict[tuple, int]:
    """YAML path (keys and list indices) -> 1-based line number, from the composed node tree."""
    lines: dict[tuple, int] = {}

    def walk(node, path: tuple) -> None:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                lines[(*path, key.value)] = key.start_mark.line + 1
                walk(value, (*path, key.value))
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                lines[(*path, i)] = item.start_mark.line + 1
                walk(item, (*path, i))

    root = yaml.compose(text, Loader=yaml.SafeLoader)
    if root is not None:
        lines[()] = root.start_mark.line + 1
        walk(root, ())
    return lines


def parse_recipe(text: str, source: str = "<recipe>") -> Recipe:
    """Validate recipe YAML.

    Raises:
        RecipeError: one line ``SOURCE:LINE: key.path: problem`` (unknown keys are named).
    """
    try:
        data = yaml.safe_load(text)
        lines = _line_map(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise RecipeError(f"{source}{where}: not valid YAML ({problem})") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{source}:1: a recipe is a mapping (name, prune, finetune, distillation)")
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()
        err = errors[0]
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        line = None
        for cut in range(len(loc), -1, -1):
            if loc[:cut] in lines:
                line = lines[loc[:cut]]
                break
        path = ".".join(str(p) for p in loc) or "recipe"
        if err["type"] == "extra_forbidden":
            message = f"unknown key {loc[-1]!r}"
        elif err["type"] == "missing":
            message = f"missing key {loc[-1]!r}"
        else:
            message = err["msg"].removeprefix("Value error, ")
        more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
        raise RecipeError(f"{source}:{line or 1}: {path}: {message}{more}") from None


def load_recipe(name_or_path: str | Path) -> Recipe:
    """Load a shipped recipe by name, or a recipe file by path.

    Raises:
        RecipeError: unknown name (the message lists the shipped ones), unreadable or invalid file.
    """
    path = Path(name_or_path)
    if not path.is_file():
        shipped = recipes_dir() / f"{name_or_path}.yaml"
        if not shipped.is_file():
            names = ", ".join(sorted(p.stem for p in recipes_dir().glob("*.yaml")))
            raise RecipeError(f"unknown recipe {str(name_or_path)!r}: not a file, nor a shipped recipe ({names})")
        path = shipped
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise RecipeError(f"{path}: cannot read ({exc})") from None
    return parse_recipe(text, str(path))
