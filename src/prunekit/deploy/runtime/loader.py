"""Load a prunekit package: verify every file's sha256, then build the model.

- Hugging Face packages: the architecture from ``config/`` is built with ``transformers``,
  dense tensors are loaded into it, and every ``nn.Linear`` whose weight is stored sparse is
  replaced by a :class:`SparseLinear` running prunekit's ops.
- State-dict packages: :class:`SparseStateDict`, one :class:`SparseLinear` per 2-D weight
  (with its ``.bias`` when present) plus the remaining dense tensors.

Needs only torch and safetensors (plus transformers for Hugging Face architectures).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from ...errors import IntegrityError, PrunekitError
from ...formats import EncodedTensor, decode
from ...kernels import cslt_tune
from .manifest import WEIGHTS, Manifest, TensorEntry, read_manifest, verify_files
from .sparse_linear import SparseLinear


def _encoded(handle, entry: TensorEntry) -> EncodedTensor:
    try:
        comps = {comp: handle.get_tensor(key) for comp, key in entry.components.items()}
    except Exception as exc:  # safetensors raises its own error types
        raise IntegrityError(f"{WEIGHTS}: cannot read {entry.name} ({exc})") from None
    return EncodedTensor(entry.format, tuple(entry.shape), entry.dtype, entry.params, comps)


@dataclass
class SparseStateDict:
    """A state-dict package: sparse linear layers by weight name, and the other tensors."""

    layers: dict[str, SparseLinear] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def layer(self, name: str) -> SparseLinear:
        """The layer of weight ``name`` (``fc1.weight`` or ``fc1``).

        Raises:
            PrunekitError: no such layer.
        """
        for key in (name, f"{name}.weight"):
            if key in self.layers:
                return self.layers[key]
        raise PrunekitError(f"no layer {name!r} in the package; layers: {', '.join(self.layers) or 'none'}")


@dataclass
class LoadedPackage:
    """A loaded package: the manifest, the model (``nn.Module`` or :class:`SparseStateDict`), and paths."""

    path: Path
    manifest: Manifest
    model: nn.Module | SparseStateDict

    @property
    def config_dir(self) -> Path | None:
        rel = self.manifest.model.get("config_dir")
        return self.path / rel if rel else None


def _build_hf(path: Path, manifest: Manifest, handle, device: str) -> nn.Module:
    try:
        import transformers
    except ImportError:
        raise PrunekitError("this package holds a Hugging Face model: install transformers to run it") from None
    config_dir = path / manifest.model["config_dir"]
    config = transformers.AutoConfig.from_pretrained(config_dir)
    arch = manifest.model.get("architecture")
    cls = getattr(transformers, arch, None) if arch else None
    model = cls(config) if cls is not None else transformers.AutoModel.from_config(config)
    entries = {e.name: e for e in manifest.tensors}
    float_dtypes = [e.dtype for e in manifest.tensors if e.dtype in ("float32", "float16", "bfloat16", "float64")]
    if float_dtypes:
        model.to(getattr(torch, max(set(float_dtypes), key=float_dtypes.count)))
    dense_state, sparse = {}, {}
    for name, entry in entries.items():
        enc = _encoded(handle, entry)
        try:
            owner = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        except AttributeError:
            owner = None
        if entry.format != "dense" and name.endswith(".weight") and isinstance(owner, nn.Linear):
            sparse[name] = enc
        else:
            dense_state[name] = decode(enc).reshape(entry.orig_shape)
    missing, _ = model.load_state_dict(dense_state, strict=False)
    missing = [m for m in missing if m not in sparse and m not in _tied_names(model)]
    if missing:
        raise IntegrityError(f"package lacks tensors the model needs: {', '.join(missing[:5])}")
    for name, enc in sparse.items():
        parent_name, _, child = name.rsplit(".", 1)[0].rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        linear = getattr(parent, child)
        setattr(parent, child, SparseLinear(enc, linear.bias))
    return model.eval().to(device)


def _tied_names(model: nn.Module) -> set[str]:
    keys = getattr(model, "_tied_weights_keys", None) or []
    return set(keys) if not isinstance(keys, dict) else set(keys)


def _build_state_dict(manifest: Manifest, handle, device: str) -> SparseStateDict:
    out = SparseStateDict()
    names = {e.name for e in manifest.tensors}
    for entry in manifest.tensors:
        enc = _encoded(handle, entry)
        if entry.format != "dense" and len(entry.orig_shape) == 2:
            bias = None
            if entry.bias_name in names:
                bias_entry = next(e for e in manifest.tensors if e.name == entry.bias_name)
                bias = decode(_encoded(handle, bias_entry))
            out.layers[entry.name] = SparseLinear(enc, bias).to(device)
        else:
            out.tensors[entry.name] = decode(enc).reshape(entry.orig_shape).to(device)
    return out


def load(package: str | Path, device: str = "cpu", verify: bool = True) -> LoadedPackage:
    """Load a package directory; every file's sha256 is checked before any tensor is used.

    The cuSPARSELt configuration ids the export searched (``manifest.tuning``) are handed to prunekit's cuSPARSELt
    binding when it loads on a GPU of the same name (``kernels/cslt_tune.py``), so the 2:4 layers run without a search.

    Raises:
        IntegrityError: missing/invalid manifest, a tampered or missing file.
        PrunekitError: transformers missing for a Hugging Face package.
    """
    path = Path(package)
    if not path.is_dir():
        raise IntegrityError(f"package not found: {path}")
    manifest = read_manifest(path)
    if verify:
        verify_files(path, manifest)
    with safe_open(str(path / WEIGHTS), framework="pt") as handle:
        if manifest.model["kind"] == "hf":
            model = _build_hf(path, manifest, handle, device)
        else:
            model = _build_state_dict(manifest, handle, device)
    cslt_tune.stage(manifest.tuning.get("cslt"))
    return LoadedPackage(path, manifest, model)


def _pooling(config_dir: Path) -> tuple[str | None, bool]:
    """sentence-transformers pooling mode (``mean``/``cls``/``max``) and whether it normalizes."""
    modules_file = config_dir / "modules.json"
    if not modules_file.is_file():
        return None, False
    modules = json.loads(modules_file.read_text())
    mode, normalize = None, False
    for module in modules:
        kind = module.get("type", "")
        if kind.endswith("Pooling"):
            cfg_file = config_dir / module.get("path", "") / "config.json"
            cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {"pooling_mode_mean_tokens": True}
            mode = (
                "cls" if cfg.get("pooling_mode_cls_token") else "max" if cfg.get("pooling_mode_max_tokens") else "mean"
            )
        elif kind.endswith("Normalize"):
            normalize = True
    return mode, normalize


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, mode: str, normalize: bool) -> torch.Tensor:
    """Sentence embedding ``(batch, hidden)`` from ``hidden: (batch, tokens, hidden)`` (sentence-transformers pooling)."""
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    if mode == "cls":
        emb = hidden[:, 0]
    elif mode == "max":
        emb = hidden.masked_fill(mask == 0, float("-inf")).amax(dim=1)
    else:
        emb = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
    return torch.nn.functional.normalize(emb, dim=-1) if normalize else emb


@torch.inference_mode()
def run_hf(
    model: nn.Module, config_dir: Path, texts: list[str] | None = None, inputs: dict | None = None
) -> dict[str, torch.Tensor]:
    """Run a Hugging Face model on texts (tokenized with the package's tokenizer) or on input tensors.

    Returns:
        ``last_hidden_state`` or ``logits`` (the model's first output), and ``sentence_embedding``
        for sentence-transformers models.
    """
    if texts is not None:
        import transformers

        tokenizer = transformers.AutoTokenizer.from_pretrained(config_dir)
        inputs = dict(tokenizer(texts, padding=True, truncation=True, return_tensors="pt"))
    device = next(model.buffers(), torch.empty(0)).device
    inputs = {k: v.to(device) for k, v in (inputs or {}).items()}
    outputs = model(**inputs)
    first_name = "logits" if hasattr(outputs, "logits") else "last_hidden_state"
    first = outputs[0]
    result = {first_name: first}
    mode, normalize = _pooling(config_dir)
    if mode is not None and first_name == "last_hidden_state":
        mask = inputs.get("attention_mask", torch.ones(first.shape[:2], device=first.device))
        result["sentence_embedding"] = pool(first, mask, mode, normalize)
    return result


@torch.inference_mode()
def run(
    package: LoadedPackage, texts: list[str] | None = None, inputs: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """Run a loaded package.

    Hugging Face packages take ``texts`` or model ``inputs`` (``input_ids``, ``attention_mask``...).
    State-dict packages take ``inputs`` keyed by layer name (``fc1`` or ``fc1.weight``), each
    ``(..., in_features)``, and return each layer's output under the same key.

    Raises:
        PrunekitError: texts for a non-HF package, or an unknown layer name.
    """
    if isinstance(package.model, SparseStateDict):
        if texts:
            raise PrunekitError("--text needs a Hugging Face text model; this package is a state dict (use --input)")
        return {name: package.model.layer(name)(x) for name, x in (inputs or {}).items()}
    return run_hf(package.model, package.config_dir, texts, inputs)
