"""Decode-shaped MLP blocks end to end: prunekit's sparse layers against dense ``nn.Linear``, with the nm24 decode
kernel's programmatic dependent launch (PDL) on and off, in one run.

``benchmarks/spmm.py`` and ``nm24_sweep.py`` time many calls of one layer back to back, where each call is preceded by
the same kernel. In a model a sparse matmul follows other kernels (norms, activations, residual adds), which do not let
their dependents launch early, so PDL can hide less there. This times the chain a decode step runs: ``blocks`` blocks
of ``x = x + down(relu(up(layer_norm(x))))`` with ``x: (N, hidden)``, ``up: hidden -> inner`` and ``down: inner ->
hidden`` (LLaMA-7B's MLP sizes by default), for

- ``dense``: ``nn.Linear`` (cuBLAS);
- ``csr``: ``SparseLinear`` on CSR weights at ``--sparsity`` (the runtime's eager route: the bitmap kernel's C++ entry
  where ``"auto"`` takes it, else the CSR entry);
- ``nm``: ``SparseLinear`` on 2:4 weights (the 2:4 decode kernel's C++ entry);
- ``bsr``: ``SparseLinear`` on BSR weights, ``--bsr-block`` square blocks kept at random with probability
  ``1 - --sparsity``, static mode (the stored schedule; the lean decode kernel at N <= 16).

The sparse chains run with their kernel's PDL switch at ``1`` (PDL where the kernel can use it, the default) and
``0``: ``$PRUNEKIT_NM24_PDL`` (csr, nm) or ``$PRUNEKIT_BSR_PDL`` (bsr). Each chain is timed
as a CUDA-graph replay of the whole chain (device time, median over replays) and as eager calls under
``torch.inference_mode`` (host overhead included); the first replay's output is checked against float64 with the same
weights. Prints a table and writes ``--out`` JSON (device, torch version, date).

``--block qkv`` times attention-input blocks instead: ``q, k, v = Wq h, Wk h, Wv h`` (each ``hidden -> hidden``) with
``h = layer_norm(x)``, then ``x = x + q + k + v``, so the three sparse kernels run back to back, the case where
programmatic dependent launch can pay (no attention: only the projections' order of kernels matters here).

    PYTHONPATH=src python benchmarks/decode_chain.py --out benchmarks/results/decode-chain-<dev>-<date>.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from prunekit import formats
from prunekit.deploy.runtime.sparse_linear import SparseLinear
from prunekit.kernels.testing import env_setting, random_sparse_weight, relative_error

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spmm import _ms_between as _ms  # noqa: E402  (CUDA-event milliseconds of one call, as the SpMM benchmark)

console = Console()
PDL_ENV = "PRUNEKIT_NM24_PDL"
BSR_PDL_ENV = "PRUNEKIT_BSR_PDL"


def weight_24(out_f: int, in_f: int, gen: torch.Generator) -> torch.Tensor:
    """``(out_f, in_f)`` float32 2:4 weight: the 2 largest of every 4 N(0, 1) entries."""
    w = torch.randn(out_f, in_f // 4, 4, generator=gen)
    keep = torch.zeros_like(w, dtype=torch.bool).scatter_(2, w.abs().topk(2, dim=2).indices, True)
    return (w * keep).reshape(out_f, in_f)


def build(
    kind: str,
    hidden: int,
    inner: int,
    blocks: int,
    sparsity: float,
    dtype: torch.dtype,
    seed: int,
    block: str = "mlp",
    bsr_block: int = 64,
) -> list:
    """``blocks`` lists of (CUDA module, dense float64 weight): (up, down) for ``mlp``, (q, k, v) for ``qkv``."""
    gen = torch.Generator().manual_seed(seed)
    shapes = ((inner, hidden), (hidden, inner)) if block == "mlp" else ((hidden, hidden),) * 3
    layers = []
    for _ in range(blocks):
        pair = []
        for out_f, in_f in shapes:
            if kind == "nm":
                w = weight_24(out_f, in_f, gen)
            elif kind == "csr":
                w = random_sparse_weight(out_f, in_f, sparsity, torch.float32, "cpu", gen)
            elif kind == "bsr":
                keep = torch.rand(out_f // bsr_block, in_f // bsr_block, generator=gen) >= sparsity
                mask = keep.repeat_interleave(bsr_block, 0).repeat_interleave(bsr_block, 1)
                w = torch.randn(out_f, in_f, generator=gen) * mask
            else:
                w = torch.randn(out_f, in_f, generator=gen)
            w = w * (2.0 / in_f) ** 0.5 / (1.0 if kind == "dense" else (1 - (0.5 if kind == "nm" else sparsity)) ** 0.5)
            w = w.to(dtype)
            if kind == "dense":
                module = torch.nn.Linear(in_f, out_f, bias=False).to(dtype)
                module.weight.data.copy_(w)
            else:
                fmt, params = {
                    "nm": ("nm", {"n": 2, "m": 4}),
                    "csr": ("csr", {}),
                    "bsr": ("bsr", {"block_rows": bsr_block, "block_cols": bsr_block}),
                }[kind]
                module = SparseLinear(formats.encode(fmt, w, params))
            pair.append((module.cuda(), w.double().cuda()))
        layers.append(pair)
    return layers


def forward(layers: list, x: torch.Tensor) -> torch.Tensor:
    for block in layers:
        h = F.layer_norm(x, x.shape[-1:])
        if len(block) == 2:  # mlp
            (up, _), (down, _) = block
            x = x + down(torch.relu(up(h)))
        else:  # qkv: the three projections back to back, then the adds
            q, k, v = (module(h) for module, _ in block)
            x = x + q + k + v
    return x


def reference(layers: list, x: torch.Tensor) -> torch.Tensor:
    x = x.double()
    for block in layers:
        h = F.layer_norm(x, x.shape[-1:])
        if len(block) == 2:
            (_, w_up), (_, w_down) = block
            x = x + torch.relu(h @ w_up.t()) @ w_down.t()
        else:
            x = x + sum(h @ w.t() for _, w in block)
    return x


def time_chain(layers: list, x: torch.Tensor, replays: int, eager_trials: int) -> dict:
    """Graph replay (device) and eager (host included) ms per chain, and the first output's error vs float64."""
    with torch.inference_mode():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                forward(layers, x)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = forward(layers, x)
        graph.replay()
        torch.cuda.synchronize()
        err = relative_error(y, reference(layers, x))
        graph_ms = statistics.median(_ms(graph.replay) for _ in range(replays))
        del graph
        reps = 20

        def loop() -> None:
            for _ in range(reps):
                forward(layers, x)

        loop()
        eager_ms = statistics.median(_ms(loop) / reps for _ in range(eager_trials))
    return {"graph_ms": graph_ms, "eager_ms": eager_ms, "rel_error": err}


def environment() -> dict:
    props = torch.cuda.get_device_properties(0)
    return {
        "device": props.name,
        "sm_count": props.multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["decode_chain.py", *sys.argv[1:]]),
        "method": "CUDA events; graph_ms = median over replays of one CUDA graph of the whole chain; eager_ms = median "
        "of loops of 20 eager chains under torch.inference_mode",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--inner", type=int, default=11008)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--ns", default="1,16")
    parser.add_argument("--sparsity", type=float, default=0.9, help="of the CSR and BSR chains")
    parser.add_argument("--bsr-block", type=int, default=64, help="block rows and columns of the BSR chain")
    parser.add_argument("--kinds", default="dense,csr,nm")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--eager-trials", type=int, default=7)
    parser.add_argument("--block", choices=("mlp", "qkv"), default="mlp")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: decode_chain.py needs a CUDA GPU")
    dtype = torch.float16
    rows = []
    for kind in args.kinds.split(","):
        layers = build(
            kind, args.hidden, args.inner, args.blocks, args.sparsity, dtype, seed=0, block=args.block,
            bsr_block=args.bsr_block,
        )  # fmt: skip
        for n in (int(v) for v in args.ns.split(",")):
            x = torch.randn(n, args.hidden, generator=torch.Generator().manual_seed(n)).to(dtype).cuda()
            for setting in ("1", "0") if kind != "dense" else (None,):
                with env_setting(BSR_PDL_ENV if kind == "bsr" else PDL_ENV, setting):
                    result = time_chain(layers, x, args.replays, args.eager_trials)
                rows.append(
                    {
                        "kind": kind,
                        "n": n,
                        "pdl": {"1": "on", "0": "off"}.get(setting, "-"),
                        "sparsity": args.sparsity if kind in ("csr", "bsr") else (0.5 if kind == "nm" else 0.0),
                        **result,
                    }
                )
        del layers
        torch.cuda.empty_cache()
    dense = {r["n"]: r for r in rows if r["kind"] == "dense"}
    for r in rows:
        r["graph_vs_dense"] = dense[r["n"]]["graph_ms"] / r["graph_ms"] if r["n"] in dense else None
        r["eager_vs_dense"] = dense[r["n"]]["eager_ms"] / r["eager_ms"] if r["n"] in dense else None
    meta = environment()
    meta.update(
        hidden=args.hidden, inner=args.inner, blocks=args.blocks, block=args.block, dtype="float16",
        bsr_block=args.bsr_block,
    )  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"environment": meta, "rows": rows}, indent=1))
    shape = (
        f"{args.hidden}->{args.inner}->{args.hidden}" if args.block == "mlp" else f"3 x {args.hidden}->{args.hidden}"
    )
    table = Table(title=f"{args.blocks} {args.block} blocks {shape}, fp16 ({meta['device']})")
    for col in ("kind", "N", "PDL", "graph us", "vs dense", "eager us", "vs dense", "rel. err"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r["kind"],
            str(r["n"]),
            r["pdl"],
            f"{1e3 * r['graph_ms']:.1f}",
            f"{r['graph_vs_dense']:.2f}x" if r["graph_vs_dense"] else "-",
            f"{1e3 * r['eager_ms']:.1f}",
            f"{r['eager_vs_dense']:.2f}x" if r["eager_vs_dense"] else "-",
            f"{r['rel_error']:.1e}",
        )
    console.print(table)


if __name__ == "__main__":
    main()
