"""Export a pruned checkpoint as a deployable package directory (see docs/ARCHITECTURE.md)::

    PACKAGE/
      manifest.json        schema_version, source + sha256, model, per-tensor entries, sha256 of every file,
                           tuning (the 2:4 layers' cuSPARSELt configuration ids, searched here on a GPU)
      weights.safetensors  kernel-ready components (see prunekit.deploy.convert)
      config/              the source's HF config, tokenizer and pooling files (HF checkpoints)
      runtime/             self-contained loader: needs torch + safetensors (+ transformers for HF)
      REPORT.md            the memory report

The package is built in a temporary directory and renamed into place.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import prunekit

from ..errors import KernelUnavailable
from ..io import atomic_path, check_output, open_checkpoint, sha256_file
from ..kernels import cslt_tune
from .convert import ConvertResult, write_converted
from .report import render_markdown, report_from_weights, tuning_summary
from .runtime.manifest import MANIFEST, SCHEMA_VERSION, WEIGHTS, Manifest

Progress = Callable[[int, int, str], None]

# Parts of the prunekit source tree that make up the runtime (torch/safetensors-only, relative imports).
RUNTIME_PARTS = ("errors.py", "formats", "kernels", "deploy/runtime")
_RUNTIME_INIT = '''"""prunekit runtime, exported with this package. Needs torch and safetensors (+ transformers for HF models).

    import sys; sys.path.insert(0, PACKAGE_DIR)
    import runtime
    pkg = runtime.load(PACKAGE_DIR)          # verifies every sha256 first
    outputs = runtime.run(pkg, texts=["..."])
"""

from .deploy.runtime import *  # noqa: F401,F403
from .deploy.runtime import __all__  # noqa: F401
'''


@dataclass
class ExportResult:
    """The package path, the manifest written, the conversion result, and one sentence on the cuSPARSELt
    configuration search (what it stored, or why it did not run)."""

    output: Path
    manifest: Manifest
    convert: ConvertResult
    tuning_note: str = ""


def _cannot_tune(reason: str) -> KernelUnavailable:
    return KernelUnavailable(f"--tune cannot search cuSPARSELt configurations here: {reason}")


def search_cslt_configs(
    entries: Sequence, tune: bool | None, tokens: Sequence[int] | None = None, progress: Progress | None = None
) -> tuple[dict, str]:
    """The manifest's ``tuning`` object for a package's tensor ``entries``, and one sentence saying what it holds or
    why it is empty ("" where the package has no 2:4 layer cuSPARSELt takes).

    The 2:4 layers the cuSPARSELt binding takes get their configuration ids searched on this machine's GPU, in a child
    process (``kernels/cslt_tune.py``), for the N buckets of ``tokens`` (default ``cslt_tune.DEFAULT_TOKENS``).

    Args:
        tune: True: search (errors if it cannot); False: do not; None: search where it can (a CUDA GPU, cuSPARSELt,
            the binding's compiler), unless ``$PRUNEKIT_CSLT_TUNE=0``.

    Raises:
        KernelUnavailable: ``tune`` is True and the search cannot run here.
        PrunekitError: a token count below ``cslt_tune.MIN_TOKENS``.
    """
    buckets = cslt_tune.buckets(tokens or cslt_tune.DEFAULT_TOKENS)
    if tune is False:
        return {}, "cuSPARSELt configurations: not searched (--no-tune)"
    shapes = cslt_tune.layer_shapes(entries)
    if not shapes:  # nothing to say (no 2:4 layer cuSPARSELt takes)
        return {}, ""
    reason = cslt_tune.unavailable_reason()
    if reason is not None:
        if tune:
            raise _cannot_tune(reason)
        return {}, f"cuSPARSELt configurations: not searched ({reason})"
    if tune is None and os.environ.get("PRUNEKIT_CSLT_TUNE") == "0":
        return {}, "cuSPARSELt configurations: not searched ($PRUNEKIT_CSLT_TUNE=0)"
    record = cslt_tune.search(shapes, buckets, progress).to_dict()
    return {"cslt": record}, tuning_summary(record)


def copy_runtime(dest: Path) -> None:
    """Copy the runtime sources (``RUNTIME_PARTS``) into ``dest`` keeping their relative layout."""
    root = Path(prunekit.__file__).parent
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "build")
    for part in RUNTIME_PARTS:
        src = root / part
        if src.is_dir():
            shutil.copytree(src, dest / part, ignore=ignore)
        else:
            (dest / part).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / part)
    (dest / "deploy" / "__init__.py").write_text('"""Exported prunekit runtime."""\n')
    (dest / "__init__.py").write_text(_RUNTIME_INIT)


def export_package(
    source: str | Path,
    output: str | Path,
    fmt: str = "auto",
    overwrite: bool = False,
    progress: Progress | None = None,
    kernels: bool = False,
    tune: bool | None = None,
    tune_tokens: Sequence[int] | None = None,
) -> ExportResult:
    """Export ``source`` (a pruned checkpoint) to the package directory ``output``.

    Args:
        kernels: build (or load) prunekit's CUDA kernels here (every shippable library: SpMM, structured,
            Kronecker-sparse) and ship them in ``runtime/kernels/prebuilt/``, so the target machine (same torch, CUDA
            and GPU arch) needs no compiler.
        tune, tune_tokens: search the 2:4 layers' cuSPARSELt configuration ids on this GPU and store them in the
            manifest (:func:`search_cslt_configs`); the runtime uses them on a GPU of the same name.

    Raises:
        CheckpointError: unreadable source. FormatError: unknown format.
        OutputExistsError: ``output`` exists without ``overwrite``.
        KernelUnavailable: ``kernels`` without a CUDA GPU and compiler (or a prebuilt library) here; ``tune`` where
            the search cannot run.
        PrunekitError: a ``tune_tokens`` count below 128.
    """
    source, output = Path(source), Path(output)
    check_output(output, overwrite, inputs=(source,))
    cslt_tune.buckets(tune_tokens or cslt_tune.DEFAULT_TOKENS)  # a bad token count fails before any work
    reason = cslt_tune.unavailable_reason() if tune else None
    if reason is not None:  # and so does --tune where the search cannot run
        raise _cannot_tune(reason)
    if kernels:
        from ..kernels import build

        build.load_all()
    ckpt = open_checkpoint(source)
    hf_config = ckpt.hf_config()
    with atomic_path(output, overwrite, directory=True) as tmp:
        converted = write_converted(ckpt, tmp / WEIGHTS, fmt, progress)
        config_dir = None
        if ckpt.kind == "hf":
            config_dir = "config"
            for rel in ckpt.config_files():
                (tmp / config_dir / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ckpt.path / rel, tmp / config_dir / rel)
        copy_runtime(tmp / "runtime")
        if kernels:
            build.copy_prebuilt(tmp / "runtime" / "kernels" / "prebuilt")
        tuning, tuning_note = search_cslt_configs(converted.entries, tune, tune_tokens, progress)
        report = report_from_weights(str(ckpt.path), tmp / WEIGHTS, converted.entries)
        report.tuning_note = tuning_note
        (tmp / "REPORT.md").write_text(render_markdown(report))
        files = {
            p.relative_to(tmp).as_posix(): sha256_file(p)
            for p in sorted(tmp.rglob("*"))
            if p.is_file() and p.name != MANIFEST
        }
        architectures = (hf_config or {}).get("architectures") or [None]
        manifest = Manifest(
            schema_version=SCHEMA_VERSION,
            prunekit_version=prunekit.__version__,
            created=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            source={"path": str(ckpt.path), "kind": ckpt.kind, "sha256": ckpt.source_sha256()},
            model={
                "kind": "hf" if ckpt.kind == "hf" else "state_dict",
                "architecture": architectures[0],
                "config_dir": config_dir,
            },
            tensors=converted.entries,
            files=files,
            tuning=tuning,
        )
        (tmp / MANIFEST).write_text(json.dumps(manifest.to_dict(), indent=1) + "\n")
    converted.output = output / WEIGHTS
    return ExportResult(output, manifest, converted, tuning_note)
