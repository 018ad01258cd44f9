"""The memory report: per pruned layer, its sparsity and its exact bytes in every format.

Works on a pruned checkpoint (formats chosen as ``convert --format auto`` would) or on an
exported package (the formats it stores). Rendered as a rich table by the CLI, as Markdown
in a package's REPORT.md, as JSON, and as a PNG plot (sparsity and bytes saved per layer).

Beside the stored bytes, each row gives the bytes of the decode plan the runtime builds in GPU memory the first time
the layer runs at decode sizes on a GPU, if it does: the bitmap plan of an fp16/bf16 CSR layer where ``"auto"`` can
take the bitmap kernel (at N = 2-256 tokens), the 2:4 decode plan of an fp16/bf16 2:4 layer (N = 2-16). It lives beside the stored
weight, so a decoding model's GPU memory is the stored bytes plus these.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import FormatError
from ..formats import EncodedTensor, decode, get_format
from ..io import open_checkpoint
from ..kernels import gpu, nm24
from ..kernels.spmm_bitmap_plan import bitmap_plan_nbytes
from .convert import iter_converted, pattern_params
from .runtime.manifest import MANIFEST, WEIGHTS, TensorEntry, read_manifest

REPORT_FORMATS = ("csr", "bsr", "nm", "bitmask", "ks")


@dataclass
class LayerRow:
    """One pruned tensor. Byte counts are exact stored sizes; None = the format cannot hold it."""

    name: str
    shape: list[int]
    pattern: str
    sparsity: float
    dense_nbytes: int
    format_nbytes: dict[str, int | None]
    stored_format: str
    stored_nbytes: int
    decode_plan_nbytes: int | None = None  # GPU memory the runtime adds at decode sizes (module docstring)

    @property
    def ratio(self) -> float:
        """Stored bytes / dense bytes (lower is better)."""
        return self.stored_nbytes / self.dense_nbytes if self.dense_nbytes else 1.0


@dataclass
class Report:
    """Per-layer rows and totals over the whole model (pruned and dense tensors)."""

    source: str
    rows: list[LayerRow] = field(default_factory=list)
    total_dense_nbytes: int = 0
    total_stored_nbytes: int = 0
    tuning_note: str | None = None  # a package's cuSPARSELt configuration ids searched at export (tuning_summary)

    @property
    def pruned_dense_nbytes(self) -> int:
        return sum(r.dense_nbytes for r in self.rows)

    @property
    def pruned_stored_nbytes(self) -> int:
        return sum(r.stored_nbytes for r in self.rows)

    def to_dict(self) -> dict:
        return {
            "source": self.source,
            "layers": [{**asdict(r), "ratio": r.ratio} for r in self.rows],
            "totals": {
                "model_dense_nbytes": self.total_dense_nbytes,
                "model_stored_nbytes": self.total_stored_nbytes,
                "pruned_layers_dense_nbytes": self.pruned_dense_nbytes,
                "pruned_layers_stored_nbytes": self.pruned_stored_nbytes,
                "model_ratio": self.total_stored_nbytes / self.total_dense_nbytes if self.total_dense_nbytes else 1.0,
            },
            "tuning_note": self.tuning_note,
        }


def tuning_summary(record: dict | None) -> str | None:
    """One sentence on a package's ``tuning.cslt`` record (``kernels/cslt_tune.TuneResult.to_dict``), or None."""
    if not record:
        return None
    configs = record["configs"]
    failed = sum(c["failed"] is not None for c in configs)
    kept = sum(c["config_id"] >= 0 for c in configs)
    shapes = len({(c["m"], c["k"], c["dtype"], c["bias"]) for c in configs})
    return (
        f"cuSPARSELt configurations: {len(configs)} products of {shapes} 2:4 layer shape{'s' if shapes != 1 else ''} "
        f"searched on {record['device']} in {record['elapsed_s']:.1f} s at export (N buckets "
        f"{', '.join(map(str, record['tokens']))}; {kept} with an id other than the default selection"
        + (f", {failed} failed and pinned to the default" if failed else "")
        + "), used by the runtime on a GPU of the same name."
    )


def format_nbytes(weight2d: torch.Tensor, pattern: str | None) -> dict[str, int | None]:
    """Exact bytes of ``weight2d`` in each of :data:`REPORT_FORMATS` (None where it does not fit)."""
    params = pattern_params(pattern)
    sizes: dict[str, int | None] = {}
    for name in REPORT_FORMATS:
        try:
            sizes[name] = get_format(name).encode(weight2d, params).nbytes
        except FormatError:
            sizes[name] = None
    return sizes


def decode_plan_nbytes(enc: EncodedTensor) -> int | None:
    """Bytes of the plan the runtime builds in GPU memory beside ``enc`` when the layer runs at decode sizes on a GPU,
    or None when it builds none: an fp16/bf16 CSR weight where ``"auto"`` takes the bitmap kernel at some N in 2 to
    ``gpu.BITMAP_WIDE_MAX_N`` (``gpu.plan_spmm`` with this weight's stored entries and the current settings, at every N
    up to 16 and at the first N of each wider rule; ``spmm_bitmap_plan``), an fp16/bf16
    2:4 weight (``nm24.plan_nbytes``). Other formats run without a plan of that size."""
    if enc.dtype not in ("float16", "bfloat16") or len(enc.shape) != 2:
        return None
    m, k = (int(v) for v in enc.shape)
    if enc.format == "nm" and (int(enc.params.get("n", 0)), int(enc.params.get("m", 0))) == (2, 4):
        return nm24.plan_nbytes(m, k)
    if enc.format != "csr":
        return None
    c = enc.components
    dtype = getattr(torch, enc.dtype)
    nnz = c["values"].numel()
    sizes = (*range(gpu.BITMAP_MIN_N, gpu.BITMAP_MAX_N + 1), gpu.BITMAP_MAX_N + 1, gpu.DIRECT_MID_N_MIN_N, gpu.TC_MIN_N)
    if not any(gpu.plan_spmm(m, k, n, nnz, 132, "auto", dtype).variant == "bitmap" for n in sizes):
        return None
    return bitmap_plan_nbytes(c["values"], c["row_offsets"], c["column_indices"], m, k)


def _row(entry: TensorEntry, enc: EncodedTensor, weight2d: torch.Tensor) -> LayerRow:
    sizes = format_nbytes(weight2d, entry.pattern)
    if enc.format in sizes and sizes[enc.format] is None:  # a ks chain: only its stored factors hold it
        sizes[enc.format] = enc.nbytes
    return LayerRow(
        name=entry.name,
        shape=list(entry.orig_shape),
        pattern=entry.pattern or "",
        sparsity=float(entry.sparsity or 0.0),
        dense_nbytes=entry.dense_nbytes,
        format_nbytes=sizes,
        stored_format=enc.format,
        stored_nbytes=enc.nbytes,
        decode_plan_nbytes=decode_plan_nbytes(enc),
    )


def report_from_weights(source: str, weights: Path, entries: list[TensorEntry]) -> Report:
    """Report over a weights file written by ``convert``/``export`` and its tensor entries."""
    report = Report(source)
    with safe_open(str(weights), framework="pt") as handle:
        for entry in entries:
            report.total_dense_nbytes += entry.dense_nbytes
            report.total_stored_nbytes += entry.nbytes
            if entry.pattern is None:
                continue
            comps = {c: handle.get_tensor(k) for c, k in entry.components.items()}
            enc = EncodedTensor(entry.format, tuple(entry.shape), entry.dtype, entry.params, comps)
            report.rows.append(_row(entry, enc, decode(enc)))
    return report


def build_report(path: str | Path) -> Report:
    """Report for a pruned checkpoint (formats as ``convert --format auto``) or an exported package.

    Raises:
        CheckpointError / IntegrityError: unreadable input.
    """
    path = Path(path)
    if path.is_dir() and (path / MANIFEST).is_file():
        manifest = read_manifest(path)
        report = report_from_weights(str(path), path / WEIGHTS, manifest.tensors)
        report.tuning_note = tuning_summary(manifest.tuning.get("cslt"))
        return report
    report = Report(str(path))
    for item in iter_converted(open_checkpoint(path), "auto"):
        report.total_dense_nbytes += item.entry.dense_nbytes
        report.total_stored_nbytes += item.entry.nbytes
        if item.entry.pattern is not None:
            report.rows.append(_row(item.entry, item.encoded, decode(item.encoded)))
    return report


def human_bytes(n: int | None) -> str:
    """``1536`` -> ``"1.5 KiB"``; None -> ``"-"``."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{n} B"


def render_markdown(report: Report) -> str:
    """The report as a Markdown document (REPORT.md)."""
    head = "| layer | shape | pattern | sparsity | dense | " + " | ".join(REPORT_FORMATS) + " | stored | ratio |"
    head += " GPU decode plan |"
    lines = [
        "# Memory report",
        "",
        f"Source: `{report.source}`. Bytes are exact stored sizes; `-` means the format cannot hold the layer. "
        "`GPU decode plan`: what the runtime adds in GPU memory, beside the stored weight, once the layer runs at "
        "decode sizes on a GPU (CSR: N = 2-256 tokens where the bitmap kernel runs; 2:4: N = 2-16; `-`: nothing of "
        "that kind).",
        "",
        head,
        "|" + "---|" * (head.count("|") - 1),
    ]
    for r in report.rows:
        sizes = " | ".join(human_bytes(r.format_nbytes.get(f)) for f in REPORT_FORMATS)
        lines.append(
            f"| {r.name} | {'x'.join(map(str, r.shape))} | {r.pattern} | {r.sparsity:.1%} | {human_bytes(r.dense_nbytes)} "
            f"| {sizes} | {r.stored_format} {human_bytes(r.stored_nbytes)} | {r.ratio:.3f} "
            f"| {human_bytes(r.decode_plan_nbytes)} |"
        )
    totals = report.to_dict()["totals"]
    lines += [
        "",
        f"Pruned layers: {human_bytes(report.pruned_dense_nbytes)} dense -> {human_bytes(report.pruned_stored_nbytes)} stored.",
        f"Whole model: {human_bytes(report.total_dense_nbytes)} dense -> {human_bytes(report.total_stored_nbytes)} stored "
        f"(ratio {totals['model_ratio']:.3f}).",
    ]
    plans = [r.decode_plan_nbytes for r in report.rows if r.decode_plan_nbytes is not None]
    if plans:
        lines.append(
            f"GPU decode plans, at decode sizes on a GPU: {human_bytes(sum(plans))} more, for {len(plans)} of the "
            f"{len(report.rows)} pruned layers."
        )
    if report.tuning_note:
        lines += ["", report.tuning_note]
    lines.append("")
    return "\n".join(lines)


def save_plot(report: Report, path: str | Path) -> None:
    """PNG with two panels: sparsity per layer, and bytes saved per layer (dense - stored, MiB)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.name for r in report.rows]
    x = range(len(names))
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(8, 0.3 * len(names)), 8), sharex=True)
    ax1.bar(x, [r.sparsity * 100 for r in report.rows], color="tab:blue")
    ax1.set_ylabel("sparsity (%)")
    ax1.set_ylim(0, 100)
    ax1.set_title(f"prunekit report: {Path(report.source).name}")
    ax2.bar(x, [(r.dense_nbytes - r.stored_nbytes) / 2**20 for r in report.rows], color="tab:green")
    ax2.set_ylabel("bytes saved (MiB)")
    ax2.set_xticks(list(x))
    ax2.set_xticklabels(names, rotation=90, fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
