"""cuSPARSELt configuration ids searched at export, in a child process, and handed to the runtime's binding.

prunekit's cuSPARSELt binding (``csrc/structured/cslt/cslt_mm.cpp``) times every configuration id cuSPARSELt offers on
the first call of a 2:4 layer's product at N >= :data:`MIN_TOKENS` tokens, per shape, dtype, X layout, bias and
power-of-two N bucket, and keeps the fastest (measured on the H100: up to 2.26x faster than cuSPARSELt's default
selection; docs/PERFORMANCE_STRUCTURED.md, "Twenty-third session"). Done in the serving process, that search costs
0.01-2.6 s on the first call of each key, and a configuration that ends the process with an illegal instruction (one
did, for a column-major Y, which the binding therefore never searches) cannot be caught there.

Issue 5 asks for the plan to be fixed at export (PopSparse's static mode: Li et al. 2023). So ``prunekit export``
runs the same search for the package's 2:4 layers in a child process (:func:`search`), one product per layer shape,
dtype, X layout and N bucket, through the runtime's own ``SparseLinear`` so that the keys are the runtime's. The ids
go into ``manifest.json`` (``tuning.cslt``, :meth:`TuneResult.to_dict`). A child that dies is restarted after the
product it was running, which is recorded as failed with id -1 (cuSPARSELt's default selection), so the runtime never
tries it either. At load, :func:`stage` keeps the record, and when the binding loads on a GPU of the same name with the
same cuSPARSELt version, :func:`apply_staged` gives each id to the binding (``prunekit_cslt::store_config``): those
products then run without a search.

torch + stdlib only (copied into exported packages; the search itself runs only where prunekit is installed).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..errors import KernelUnavailable, PrunekitError

log = logging.getLogger(__name__)

MIN_TOKENS = 128  # the binding searches at N >= this (cslt_mm.cpp kTuneMinN); below it 2:4 runs the decode kernels
DEFAULT_TOKENS = (128, 256, 512, 1024, 2048, 4096, 8192)  # the N buckets searched by default
DTYPE_CODES = {"float16": 0, "bfloat16": 1}  # prunekit_cslt::store_config's dtype argument
CSLT_DTYPES = tuple(DTYPE_CODES)
TIMEOUT_BASE_S = 120.0  # a child's time limit: this, plus TIMEOUT_PER_ITEM_S per product it is given
TIMEOUT_PER_ITEM_S = 30.0
MAX_RESTARTS = 8  # children started after one that died, before the rest is left unsearched
CHILD_MODULE = "prunekit.kernels.cslt_tune"
ERROR_EXIT = 3  # the child's exit status when it cannot search at all (its last line holds the reason)

Progress = Callable[[int, int, str], None]


@dataclass(frozen=True)
class LayerShape:
    """A 2:4 layer's product as the binding keys it: weight ``(m, k)`` = ``(out_features, in_features)``, the dtype
    the layer runs in (``float16`` or ``bfloat16``) and whether it has a bias."""

    m: int
    k: int
    dtype: str
    bias: bool


@dataclass(frozen=True)
class TunedConfig:
    """One searched product: the layer's shape, ``x_row`` (activations ``(N, K)`` given as the transposed view of a
    row-major ``(K, N)``, as a preceding 2:4 layer returns them; else row-major ``(N, K)``), the N bucket (a power of
    two >= :data:`MIN_TOKENS`: N up to it and above half of it), the configuration id kept (-1: cuSPARSELt's default
    selection) and, for a product whose search ended its process, why (then the id is -1)."""

    m: int
    k: int
    dtype: str
    x_row: bool
    bias: bool
    n_bucket: int
    config_id: int
    failed: str | None = None

    @classmethod
    def from_dict(cls, data: dict) -> TunedConfig:
        return cls(**data)


@dataclass(frozen=True)
class TuneResult:
    """What :func:`search` found: the GPU's name, cuSPARSELt's version (``torch.backends.cusparselt.version()``),
    torch's version, the N buckets searched, the wall time of the whole search in seconds and one
    :class:`TunedConfig` per product."""

    device: str
    cusparselt_version: int | None
    torch: str
    tokens: list[int]
    elapsed_s: float
    configs: list[TunedConfig]

    def to_dict(self) -> dict:
        """The manifest's ``tuning.cslt`` record."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> TuneResult:
        return cls(**{**data, "configs": [TunedConfig.from_dict(c) for c in data["configs"]]})


def n_bucket(n: int) -> int:
    """The power-of-two N bucket the binding keys its choice by: ``n`` rounded up to a power of two."""
    bucket = 1
    while bucket < n:
        bucket <<= 1
    return bucket


def buckets(tokens: Iterable[int]) -> list[int]:
    """The sorted distinct N buckets of ``tokens``.

    Raises:
        PrunekitError: a token count below :data:`MIN_TOKENS` (the binding searches only from there).
    """
    tokens = list(tokens)
    low = [n for n in tokens if n < MIN_TOKENS]
    if low:
        raise PrunekitError(f"cuSPARSELt configurations are searched at N >= {MIN_TOKENS} tokens only, got {low[0]}")
    return sorted({n_bucket(int(n)) for n in tokens})


def layer_shapes(entries: Sequence) -> list[LayerShape]:
    """The distinct products of a package's 2:4 layers that the binding takes (``M % 32 == 0``, ``K % 64 == 0``).

    Args:
        entries: the manifest's tensor entries (``TensorEntry``: name, format, params, shape, orig_shape, dtype).
            A weight has a bias when its ``bias_name`` (``<name>.bias`` for ``<name>.weight``) is among them. A layer
            stored in float16 or bfloat16 runs in that dtype; one stored in another dtype is searched in both.
    """
    from .structured import CSLT_ALIGN_MK

    names = {e.name for e in entries}
    shapes = set()
    for e in entries:
        params = e.params or {}
        if e.format != "nm" or (params.get("n"), params.get("m")) != (2, 4) or len(e.orig_shape) != 2:
            continue
        m, k = (int(v) for v in e.shape)
        if m == 0 or m % CSLT_ALIGN_MK[0] or k % CSLT_ALIGN_MK[1]:
            continue
        bias = e.bias_name in names
        for dtype in (e.dtype,) if e.dtype in CSLT_DTYPES else CSLT_DTYPES:
            shapes.add(LayerShape(m, k, dtype, bias))
    return sorted(shapes, key=lambda s: (s.m, s.k, s.dtype, s.bias))


def unavailable_reason() -> str | None:
    """Why the search cannot run here (one sentence), or None: it needs a CUDA GPU of sm_80 or newer, a compiler,
    torch's cuSPARSELt and the nvidia-cusparselt wheel's headers, and prunekit's own binding (not
    ``$PRUNEKIT_CSLT_BACKEND=torch``)."""
    from . import build, structured

    reason = build.unavailable_reason()
    if reason is not None:
        return reason
    if not structured.cusparselt_available():
        return "this torch has no cuSPARSELt"
    if os.environ.get(structured.CSLT_BACKEND_ENV) == "torch":
        return f"${structured.CSLT_BACKEND_ENV}=torch turns prunekit's cuSPARSELt binding off"
    if structured.cusparselt_dir() is None:
        return "the nvidia-cusparselt wheel (headers and library) is not installed"
    return None


def _work(shapes: Sequence[LayerShape], tokens: Sequence[int]) -> list[dict]:
    return [
        {**asdict(s), "x_row": x_row, "n_bucket": b} for s in shapes for b in buckets(tokens) for x_row in (False, True)
    ]


def _signal_text(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"ended by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"ended by signal {-returncode}"
    return f"exited with status {returncode}"


def search(
    shapes: Sequence[LayerShape],
    tokens: Sequence[int] = DEFAULT_TOKENS,
    progress: Progress | None = None,
    command: Sequence[str] | None = None,
) -> TuneResult:
    """Search cuSPARSELt's configuration ids for every product of ``shapes`` in a child process.

    Each product (shape, N bucket of ``tokens``, X row-major or not) is one call of the runtime's ``SparseLinear`` on
    a random 2:4 weight of that shape with ``N = bucket`` random tokens, which makes the binding search it (forced on
    with ``$PRUNEKIT_CSLT_TUNE=1`` in the child). When a child dies or passes its time limit, the product it was
    running is recorded as failed (id -1) and a new child takes the rest, at most :data:`MAX_RESTARTS` times.

    Args:
        command: the child's command line (default: this module run by this Python); tests pass a fake one.

    Returns:
        The result; products the child could not run through the binding are left out.

    Raises:
        PrunekitError: a token count below :data:`MIN_TOKENS`.
        KernelUnavailable: the child cannot search at all (no GPU, binding or cuSPARSELt; its reason is given).
    """
    work = _work(shapes, tokens)
    command = list(command or [sys.executable, "-m", CHILD_MODULE])
    env = dict(os.environ, PRUNEKIT_CSLT_TUNE="1")
    src = str(Path(__file__).resolve().parents[2])  # the folder holding prunekit, for a child run from a source tree
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    start = time.perf_counter()
    header: dict = {}
    found: dict[int, TunedConfig] = {}
    finished: set[int] = set()  # products reported by a child or recorded as failed
    pending = list(range(len(work)))
    restarts = 0
    while pending:
        lines, returncode, reason, stderr_tail = _run_child(command, env, [dict(work[i], item=i) for i in pending])
        if not lines and (returncode != 0 or reason is not None):  # died before its first line: no product's fault
            why = reason or _signal_text(returncode)
            raise KernelUnavailable(
                f"the cuSPARSELt configuration search cannot run: its child process {why}"
                + (f" ({stderr_tail})" if stderr_tail else "")
            )
        done = set()
        for line in lines:
            if "device" in line:
                header = line
            elif "item" in line:
                i = int(line["item"])
                done.add(i)
                finished.add(i)
                if line.get("source") in (1, 2):  # 1: searched; 2: a layer of the same key before it searched it
                    found[i] = TunedConfig(**work[i], config_id=int(line["config_id"]))
                if progress is not None:
                    progress(len(finished), len(work), "searching cuSPARSELt configurations")
            elif "error" in line:
                raise KernelUnavailable(f"the cuSPARSELt configuration search cannot run: {line['error']}")
        if returncode == 0 and reason is None:
            break
        left = [i for i in pending if i not in done]
        if not left:
            break
        failed = left[0]
        finished.add(failed)
        found[failed] = TunedConfig(**work[failed], config_id=-1, failed=reason or _signal_text(returncode))
        log.warning("cuSPARSELt configuration search: %s at %s", found[failed].failed, work[failed])
        pending = left[1:]
        restarts += 1
        if restarts > MAX_RESTARTS:
            log.warning("cuSPARSELt configuration search: %d products left unsearched", len(pending))
            break
    if not header:
        raise KernelUnavailable("the cuSPARSELt configuration search cannot run: its child process gave no output")
    return TuneResult(
        device=header["device"],
        cusparselt_version=header["cusparselt_version"],
        torch=header["torch"],
        tokens=buckets(tokens),
        elapsed_s=round(time.perf_counter() - start, 3),
        configs=[found[i] for i in sorted(found)],
    )


def _run_child(command: list[str], env: dict, items: list[dict]) -> tuple[list[dict], int, str | None, str]:
    """Run one child on ``items``: its JSON lines as they came, its exit status, a reason where it was stopped for
    passing its time limit (else None), and the last line it wrote to stderr."""
    limit_s = TIMEOUT_BASE_S + TIMEOUT_PER_ITEM_S * len(items)
    with tempfile.TemporaryFile("w+") as err:  # a file, not a pipe: a chatty stderr cannot block the child
        proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        lines, returncode, reason = _read_child(proc, items, limit_s)
        err.seek(0)
        tail = [line.strip() for line in err.read().splitlines() if line.strip()]
    return lines, returncode, reason, tail[-1][:300] if tail else ""


def _read_child(proc: subprocess.Popen, items: list[dict], limit_s: float) -> tuple[list[dict], int, str | None]:
    timer = threading.Timer(limit_s, proc.kill)
    timer.start()
    lines: list[dict] = []
    try:
        proc.stdin.write(json.dumps({"items": items}))
        proc.stdin.close()
        for raw in proc.stdout:
            try:
                line = json.loads(raw)
            except json.JSONDecodeError:
                continue  # a library printing on stdout
            if isinstance(line, dict):
                lines.append(line)
        returncode = proc.wait()
    except BrokenPipeError:  # the child died before reading its work
        returncode = proc.wait()
    finally:
        stopped = not timer.is_alive() and proc.returncode == -signal.SIGKILL
        timer.cancel()
    return lines, returncode, f"passed its time limit of {limit_s:.0f} s" if stopped else None


def _child_main() -> int:
    """The child: reads ``{"items": [...]}`` on stdin; prints one JSON line with the device, then one per product
    with the id and source ``prunekit_cslt::last_config`` reports after the call (or ``{"error": ...}`` and exits
    with :data:`ERROR_EXIT` when it cannot search)."""
    items = json.loads(sys.stdin.read())["items"]
    from ..deploy.runtime.sparse_linear import SparseLinear
    from ..formats import encode
    from . import structured

    reason = unavailable_reason()
    if reason is None and not structured.native_cslt_available():
        reason = "prunekit's cuSPARSELt binding does not load"
    if reason is not None:
        print(json.dumps({"error": reason}), flush=True)
        return ERROR_EXIT
    device = torch.device("cuda")
    version = torch.backends.cusparselt.version()
    header = {"device": torch.cuda.get_device_name(device), "cusparselt_version": version, "torch": torch.__version__}
    print(json.dumps(header), flush=True)
    layer, layer_key = None, None
    with torch.inference_mode():
        for item in items:
            key = (item["m"], item["k"], item["dtype"], item["bias"])
            if key != layer_key:
                layer = None  # free the previous weight first
                layer = _random_layer(*key, device, encode, SparseLinear)
                layer_key = key
            k, n = item["k"], item["n_bucket"]
            dtype = getattr(torch, item["dtype"])
            x2d = (
                torch.randn(k, n, device=device, dtype=dtype).t()
                if item["x_row"]
                else torch.randn(n, k, device=device, dtype=dtype)
            )
            layer(x2d)
            torch.cuda.synchronize()
            weight = getattr(layer.w_values, structured._NATIVE_ATTR, None)
            if weight is None:  # the layer did not take the binding for this call
                print(json.dumps({"item": item["item"], "source": None}), flush=True)
                continue
            config_id, source = (int(v) for v in torch.ops.prunekit_cslt.last_config(weight.id))
            print(json.dumps({"item": item["item"], "config_id": config_id, "source": source}), flush=True)
    return 0


def _random_layer(m: int, k: int, dtype: str, bias: bool, device, encode, sparse_linear):
    """A ``SparseLinear`` over a random 2:4 weight ``(m, k)`` (the first two of every four columns kept: the search
    depends on the shape only) on ``device``."""
    dense = torch.randn(m, k // 4, 4, device=device, dtype=getattr(torch, dtype))
    dense[..., 2:] = 0
    encoded = encode("nm", dense.reshape(m, k), {"n": 2, "m": 4})
    b = torch.randn(m, device=device, dtype=dense.dtype) if bias else None
    return sparse_linear(encoded, b).to(device)


# --- the runtime side: ids from a package's manifest, handed to the binding -----------------------------------------

_staged: list[TuneResult] = []


def stage(record: dict | None) -> None:
    """Keep a package's ``tuning.cslt`` record for :func:`apply_staged`, and apply it now when the binding is already
    loaded. Needs no GPU."""
    if not record:
        return
    _staged.append(TuneResult.from_dict(record))
    if _binding_loaded():
        apply_staged()


def _binding_loaded() -> bool:
    try:
        torch.ops.prunekit_cslt.store_config  # noqa: B018
    except (AttributeError, RuntimeError):
        return False
    return True


def _store_op() -> Callable[..., bool]:
    return torch.ops.prunekit_cslt.store_config


def apply_staged() -> int:
    """Give the binding the staged ids whose record was searched on a GPU of the current device's name with the same
    cuSPARSELt version (others are dropped, with a log line); called when the binding loads. Returns how many ids the
    binding took (an id for a key the process already holds is not taken)."""
    if not _staged or not torch.cuda.is_available() or not _binding_loaded():
        return 0
    device = torch.cuda.get_device_name()
    version = torch.backends.cusparselt.version()
    store = _store_op()
    taken = 0
    while _staged:
        record = _staged.pop(0)
        if (record.device, record.cusparselt_version) != (device, version):
            log.info(
                "cuSPARSELt ids searched on %s (cuSPARSELt %s) not used on %s (cuSPARSELt %s): searching at run time",
                record.device, record.cusparselt_version, device, version,
            )  # fmt: skip
            continue
        for c in record.configs:
            try:
                taken += bool(store(c.m, c.k, DTYPE_CODES[c.dtype], c.x_row, c.bias, c.n_bucket, c.config_id))
            except (KeyError, RuntimeError) as exc:  # a key the binding refuses: that product searches at run time
                log.warning("cuSPARSELt id for %s not used: %s", c, exc)
    return taken


if __name__ == "__main__":
    sys.exit(_child_main())
