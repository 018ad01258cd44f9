"""The Sparse DNN Graph Challenge kernels (``csrc/spdnn/spdnn_chain.cu``): build, load and drive them.

The kernel keeps a block of inputs' features in shared memory across a chain of layers (SpMM + bias on
non-zeros + ReLU + cap, fused); between chains the host drops inputs that have become all-zero and
compacts the rest (Hidayetoglu et al., HPEC 2020, sec. III: the champion's design, plus multi-layer
fusion). Layers are given in ELL form, slot-major: ``ell_idx (layers, slots, N)`` int32 input neuron of
each (slot, output neuron), ``ell_val`` float32 (0 in padding slots).

``prunekit_spdnn::tiled`` is the same chain for any N: features stay in global memory (L2) in a blocked
layout of 16-input tiles, one launch per layer, and tiles whose inputs are all dead are skipped; it serves
N whose features do not fit in one block's shared memory (N = 65536).

Built with torch.utils.cpp_extension into the same cache as the other kernels (see ``build.py``), as
its own small library. torch + stdlib only.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .build import Extension, load_extension

CSRC_DIR = Path(__file__).resolve().parent / "csrc" / "spdnn"
SOURCES = ("spdnn_chain.cu",)
MAX_CHAIN = 64  # layers per launch once few inputs are left
CHAIN_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # feature storage types of the chain kernel
SETTLE_MIN_CHAIN = 8  # a chain this long that loses no input ends the compaction (infer_chained)
SETTLE_ENV = "PRUNEKIT_SPDNN_SETTLE"
FIRST_CHAIN = 2  # layers in the first chain launch (and the second); then doubling (infer_chained)
FIRST_CHAIN_ENV = "PRUNEKIT_SPDNN_FIRST_CHAIN"
TILE_INPUTS = 16  # inputs per tile of the tiled kernel (kTileInputs in spdnn_chain.cu; both ops live in that file)
MAX_TILED_BATCH = 65535 * TILE_INPUTS  # grid.y limit of the tiled kernel

EXTENSION = Extension(
    namespace="prunekit_spdnn",
    prefix="prunekit_spdnn",
    csrc_dir=CSRC_DIR,
    sources=SOURCES,
    headers=("../check.h",),
    probe="chain",
    description="fused SpDNN kernels",
    prebuilt=False,  # benchmark/challenge kernel: never shipped in an exported package
)


def load(verbose: bool = False) -> None:
    """Build (once per source/torch/CUDA/arch key) and load the fused kernel.

    Raises:
        KernelUnavailable: no CUDA torch, GPU, or compiler, or the build failed.
    """
    load_extension(EXTENSION, verbose)


def block_inputs(neurons: int, element_size: int = 4, buffers: int = 2) -> int:
    """Inputs per thread block of the chain kernel for N features of ``element_size`` bytes (4: float32, 2: float16 /
    bfloat16) in ``buffers`` shared-memory buffers (a one-layer launch needs 1, a chain 2); 0 when N does not fit in
    shared memory (use the tiled kernel or the reference path)."""
    load()
    return int(torch.ops.prunekit_spdnn.max_block_inputs(neurons, element_size, buffers))


def to_ell(
    row_offsets: torch.Tensor, column_indices: torch.Tensor, values: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """W^T CSR (one row per output neuron) -> slot-major ELL ``(slots, N)`` int32 indices and float32 values."""
    n = row_offsets.numel() - 1
    counts = (row_offsets[1:] - row_offsets[:-1]).long()
    slots = int(counts.max()) if n else 0
    rows = torch.repeat_interleave(torch.arange(n, device=counts.device), counts)
    slot = torch.arange(column_indices.numel(), device=counts.device) - row_offsets[:-1].long()[rows]
    idx = torch.zeros(slots, n, dtype=torch.int32, device=counts.device)
    val = torch.zeros(slots, n, dtype=torch.float32, device=counts.device)
    idx[slot, rows] = column_indices.to(torch.int32)
    val[slot, rows] = values.to(torch.float32)
    return idx, val


PACKED_MAX_NEURONS = 1 << 16  # a packed slot holds its input row in 16 bits
PACK_CHUNK_ENTRIES = 1 << 24  # ELL slots per step of pack_ell


def pack_ell(ell_idx: torch.Tensor, ell_val: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """The ELL layers as one 32-bit word per slot, for ``prunekit_spdnn::chain_packed`` and ``tiled_packed``: the input
    row in the low 16 bits, the weight's float16 bits in the high 16. Half the bytes the kernels stream per layer
    (every block reads the whole layer), and lossless: returns None unless every weight is exactly a float16 (as a
    float16 or bfloat16-trained network's weights, or the challenge's 1/16 are) and N <= 65536.

    Args:
        ell_idx: ``(layers, slots, N)`` int32 rows in 0..N-1. ell_val: the same shape, float32.
        out: where to write the words (``ell_idx`` itself packs in place: no second copy of the layers); None: a new
            tensor. Nothing is written when the packing would not be lossless.

    Returns:
        ``(layers, slots, N)`` int32 words (bit patterns; the padding slots' (0, +0.0) pair is the word 0), or None.
    """
    if ell_idx.shape[-1] > PACKED_MAX_NEURONS or ell_val.dtype != torch.float32:
        return None
    step = max(1, PACK_CHUNK_ENTRIES // max(1, ell_idx[0].numel()))  # bounds the int64 temporaries
    chunks = [slice(lo, lo + step) for lo in range(0, ell_idx.shape[0], step)]
    for part in chunks:  # every chunk first: a failed check must leave `out` untouched
        if not torch.equal(ell_val[part].to(torch.float16).to(torch.float32), ell_val[part]):  # NaN, rounding
            return None
    packed = torch.empty_like(ell_idx, dtype=torch.int32) if out is None else out
    for part in chunks:
        bits = ell_val[part].to(torch.float16).view(torch.int16).to(torch.int64) & 0xFFFF
        word = (ell_idx[part].to(torch.int64) & 0xFFFF) | (bits << 16)
        packed[part] = torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)
    return packed


def infer_fused(
    features: torch.Tensor,
    ell_idx: torch.Tensor,
    ell_val: torch.Tensor,
    bias: float,
    cap: float,
    row_pos: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
    trace: list[dict] | None = None,
    balance=None,
) -> torch.Tensor:
    """Run every layer with the shared-memory chain kernel; return the 0-based indices of inputs whose final
    row is non-zero (CPU int64, sorted).

    Args:
        features: ``(inputs, N)`` CUDA (not modified), float32, or float16 / bfloat16 (issue 7's option: features
            stored in 16 bits between layers, every layer computed in float32); other dtypes run as float32.
        ell_idx / ell_val: ``(layers, slots, N)`` (see :func:`to_ell`), on the same device.
        row_pos: ``(layers, N)`` int32 or None: the shared-memory row of each layer's input neurons, a permutation
            per layer; ``ell_idx`` must then name those rows (:func:`prunekit.spdnn.slot_order.chain_layout`).
        packed: :func:`pack_ell` of the same layers, or None: when given, the kernel streams it instead of the
            (int32, float32) pairs (the same sums, bit for bit).
        trace: passed to :func:`infer_chained` (per-launch records, for benchmarks/spdnn_profile.py).
        balance: passed to :func:`infer_chained` (several ranks: global indices are returned).

    Launches chains of 2, 2, 4, 8, ... (up to :data:`MAX_CHAIN`) layers, dropping dead inputs between them (the next
    launch reads only the live rows of the last one's output), and the rest in one launch once the survivors have
    settled (:func:`infer_chained`).
    """
    load()
    keep = features.dtype in CHAIN_DTYPES
    op = torch.ops.prunekit_spdnn.chain
    if packed is not None:
        ell_idx = ell_val = packed

        def op(y, words, _same, bias, cap, row_pos, rows):
            return torch.ops.prunekit_spdnn.chain_packed(y, words, bias, cap, row_pos, rows)

    return infer_chained(
        op,
        features,
        ell_idx,
        ell_val,
        bias,
        cap,
        keep_dtype=keep,
        row_pos=row_pos,
        gathers=True,
        trace=trace,
        one_layer=one_layer_rule(features.shape[1], 2 if keep and features.dtype != torch.float32 else 4),
        balance=balance,
    )


ONE_LAYER_MIN_WAVES = 4  # one-layer launches while the live inputs fill this many waves of blocks (one_layer_rule)


def one_layer_rule(neurons: int, element_size: int = 4):
    """The chain driver's rule for launching one layer alone: where a one-layer launch (one shared-memory buffer)
    holds more inputs per block than a chain (two buffers), as at N = 4096 (8 against 4 in float32), each block
    streams the layer's weights for twice the inputs; that pays while the live inputs fill
    :data:`ONE_LAYER_MIN_WAVES` waves of blocks over the SMs (the first layers of a network). None where both
    hold as many (N = 1024: 16)."""
    one, two = block_inputs(neurons, element_size, 1), block_inputs(neurons, element_size, 2)
    if one <= two:
        return None
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return lambda live: live >= ONE_LAYER_MIN_WAVES * sms * one


def infer_tiled(
    features: torch.Tensor,
    ell_idx: torch.Tensor,
    ell_val: torch.Tensor,
    bias: float,
    cap: float,
    out_pos: torch.Tensor | None = None,
    trace: list[dict] | None = None,
    packed: torch.Tensor | None = None,
    balance=None,
) -> torch.Tensor:
    """As :func:`infer_fused` with the tiled kernel (any N; features in global memory). Batches of more than
    :data:`MAX_TILED_BATCH` inputs are run in pieces (without ``balance``; with it, such a batch raises ValueError).

    Args:
        out_pos: ``(layers, N)`` int32 or None: the output each ELL column computes (:func:`tiled_output_order_`);
            None: column j computes output j.
        trace: passed to :func:`infer_chained`.
        packed: :func:`pack_ell` of the same layers, or None: when given, ``prunekit_spdnn::tiled_packed`` streams it
            instead of the (int32, float32) pairs (the same sums, bit for bit; ``ell_idx`` / ``ell_val`` are then
            not read and may be the words themselves).
        balance: passed to :func:`infer_chained` (several ranks: global indices are returned).
    """
    load()
    op = torch.ops.prunekit_spdnn.tiled
    if packed is not None:
        ell_idx = ell_val = packed

        def op(y, words, _same, bias, cap, *out_pos_part):
            return torch.ops.prunekit_spdnn.tiled_packed(y, words, bias, cap, *out_pos_part)

    if balance is not None:  # one piece: the ranks' collectives must pair up
        if features.shape[0] > MAX_TILED_BATCH:
            raise ValueError(f"infer_tiled: at most {MAX_TILED_BATCH} inputs per rank and batch with balance")
        return infer_chained(op, features, ell_idx, ell_val, bias, cap, out_pos=out_pos, trace=trace, balance=balance)
    parts = []
    for lo in range(0, features.shape[0], MAX_TILED_BATCH):
        part = features[lo : lo + MAX_TILED_BATCH]
        live = infer_chained(op, part, ell_idx, ell_val, bias, cap, out_pos=out_pos, trace=trace)
        parts.append(live + lo)
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


OUTPUT_ORDER_ENV = "PRUNEKIT_SPDNN_OUTPUT_ORDER"  # "0": the tiled path keeps output j in ELL column j
_SET_KEY_SEED = 20200917  # the multipliers of tiled_output_order_'s input-set key (any fixed seed)


def tiled_output_order_(ell_idx: torch.Tensor, ell_val: torch.Tensor) -> torch.Tensor:
    """Reorder each layer's ELL columns, in place, so that outputs with the same inputs sit side by side (tiled kernel).

    Each output's slots are sorted by input neuron (padding last), then the outputs are sorted by a key of their input
    set (a sum of the sorted inputs times fixed random multipliers: outputs with equal sets get equal keys, and a rare
    collision only makes the order less useful, never wrong). A warp of the tiled kernel then gathers the same feature
    row at the same slot in many lanes, one load for all of them: in the challenge networks the 16 outputs
    ``b * N/16 + j`` (b = 0..15) share their 32 inputs, so a warp reads 2 distinct rows per slot instead of 32.

    Args:
        ell_idx: ``(layers, slots, N)`` int32 input neurons; ell_val: ``(layers, slots, N)`` float32 (0: padding).
            Both are overwritten (chunks of layers at a time: no second copy of the layers).

    Returns:
        ``out_pos (layers, N)`` int32, a permutation per layer: column j of the new ELL holds the inputs of output
        ``out_pos[layer, j]``.
    """
    layers, slots, n = ell_idx.shape
    gen = torch.Generator().manual_seed(_SET_KEY_SEED)
    mult = torch.randint(1, 1 << 31, (slots,), generator=gen, dtype=torch.int64).to(ell_idx.device)
    out_pos = torch.empty(layers, n, dtype=torch.int32, device=ell_idx.device)
    step = max(1, (1 << 22) // max(1, slots * n))  # layers per chunk: bounded temporaries
    for lo in range(0, layers, step):
        part = slice(lo, lo + step)
        idx, val = ell_idx[part], ell_val[part]
        rows = idx.long()
        sort_key = torch.where(val != 0, rows, rows + n)  # padding slots sort last
        sort_key, order = sort_key.sort(dim=1, stable=True)
        set_key = (sort_key * mult[None, :, None]).sum(dim=1)  # (chunk, N); < 2^31 * 2N * slots: no overflow
        perm = set_key.argsort(dim=1, stable=True)
        cols = perm[:, None, :].expand(-1, slots, -1)  # the new column j is the old column perm[j]
        ell_idx[part] = idx.gather(1, order).gather(2, cols)
        ell_val[part] = val.gather(1, order).gather(2, cols)
        out_pos[part] = perm.to(torch.int32)
    return out_pos


TILED_PACK_ENV = "PRUNEKIT_SPDNN_TILED_PACK"  # "1": the tiled path streams packed words (pack_ell); not yet timed


def tiled_pack_enabled() -> bool:
    """Whether the tiled path packs its layers (:func:`pack_ell`, in place) where that is lossless. Opt-in
    (``$PRUNEKIT_SPDNN_TILED_PACK=1``) until it has been timed on a GPU (docs/SPDNN.md)."""
    return os.environ.get(TILED_PACK_ENV, "0").strip() == "1"


def output_order_enabled() -> bool:
    """Whether the tiled path reorders outputs (:func:`tiled_output_order_`); ``$PRUNEKIT_SPDNN_OUTPUT_ORDER=0``: no."""
    return os.environ.get(OUTPUT_ORDER_ENV, "1").strip() not in ("0", "false", "False")


def infer_chained(
    op,
    features: torch.Tensor,
    ell_idx: torch.Tensor,
    ell_val: torch.Tensor,
    bias: float,
    cap: float,
    keep_dtype: bool = False,
    row_pos: torch.Tensor | None = None,
    gathers: bool = False,
    trace: list[dict] | None = None,
    one_layer=None,
    out_pos: torch.Tensor | None = None,
    balance=None,
):
    """Drive ``op(y, idx, val, bias, cap) -> (out, alive)`` over chains of 2, 2, 4, 8, ... 64 layers with
    compaction of the live inputs between chains; return the live inputs' 0-based indices (CPU int64, sorted).

    Args:
        op: a CUDA op or :func:`emulate_tiled` (CPU tests).
        features: ``(inputs, N)``. keep_dtype: pass ``features`` in their own dtype (the chain kernel's 16-bit option)
            instead of float32.
        ell_idx / ell_val: ``(layers, slots, N)``.
        row_pos: the chain op's ``(layers, N)`` shared-memory rows, passed on sliced like the layers.
        gathers: ``op`` takes ``row_pos`` and ``rows`` (the chain op): the live rows of the last output are passed as
            ``rows`` instead of copied out of it (a copy of the live features per chain, 0.1-0.2 ms at 60000 x 1024).
        out_pos: the tiled op's ``(layers, N)`` output order (:func:`tiled_output_order_`), passed on sliced like the
            layers (without ``gathers``).
        one_layer: ``callable(live inputs) -> bool``, or None: launch one layer alone while it says so (the chain op
            holds more inputs per block with the one buffer of a one-layer launch at some N; :func:`infer_fused`).
        trace: when a list, one dict per launch is appended (``first``, ``last``, ``live_in``, ``live_out`` and, on
            CUDA, ``events``: start and end CUDA events around the launch; read them after a synchronize; with
            ``balance``, ``balanced``: live rows per rank before and after the exchange, on the launch before it).
        balance: a :class:`prunekit.spdnn.balance.Balance` (several ranks), or None. Every rank then ends a launch at
            layer ``balance.layer`` (when the network is longer), and there the ranks even out their live rows, in
            two collectives; a rank with no input left still runs its schedule up to that layer to take part. The
            returned indices are then global (``balance.offset`` added), not local.

    The first chain is 2 layers ($PRUNEKIT_SPDNN_FIRST_CHAIN, :data:`FIRST_CHAIN`): in the challenge networks the first
    layer drops almost no input, so its compaction would cost a host round trip for nothing. Once a chain of at least
    :data:`SETTLE_MIN_CHAIN` layers ends with no input lost (the survivors have settled), the remaining layers run in
    one launch: each chain costs a host round trip (the compaction reads the alive flags), and a block whose inputs
    all die later still stops at once. ``$PRUNEKIT_SPDNN_SETTLE=0`` keeps chains of at most :data:`MAX_CHAIN`."""
    layers = ell_idx.shape[0]
    live = torch.arange(features.shape[0], device=features.device)
    y = (features if keep_dtype else features.float()).contiguous()
    settle = os.environ.get(SETTLE_ENV, "1").strip() not in ("0", "false", "False")
    first = max(1, int(os.environ.get(FIRST_CHAIN_ENV, FIRST_CHAIN)))
    rows = None  # gathers: the rows of y still alive (None: all)
    done, chain, chains = 0, first, 0  # chains: launches of the doubling schedule so far

    def local_live() -> int:
        return y.shape[0] if rows is None else rows.numel()

    pending = balance is not None and 0 < balance.layer < layers  # the exchange is still ahead
    if balance is not None:
        live = live + balance.offset
    while done < layers and (local_live() > 0 or pending):
        single = one_layer is not None and one_layer(local_live())
        stop = min(layers, done + (1 if single else chain))
        if pending:
            stop = min(stop, balance.layer)
        if gathers:
            extra = (None if row_pos is None else row_pos[done:stop], rows)
        else:
            extra = () if out_pos is None else (out_pos[done:stop],)
        if trace is not None and y.is_cuda:
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        if local_live() > 0:
            y, alive = op(y, ell_idx[done:stop], ell_val[done:stop], bias, cap, *extra)
        else:  # balance: this rank has no input left, but still takes part in the collectives
            y, rows = y[:0], None
            alive = torch.zeros(0, dtype=torch.int32, device=y.device)
        if trace is not None:
            trace.append({"first": done, "last": stop - 1, "live_in": int(alive.numel())})
            if y.is_cuda:
                events[1].record()
                trace[-1]["events"] = events
        keep = alive.nonzero().squeeze(1)  # the chain's one host round trip (boolean indexing would add two more)
        lost = keep.numel() < alive.numel()
        if trace is not None:
            trace[-1]["live_out"] = int(keep.numel())
        if lost:
            live = live.index_select(0, keep)
            if gathers:
                rows = keep
            else:
                y = y.index_select(0, keep)
        elif gathers:
            rows = None
        if pending and stop == balance.layer:  # every rank is here: even out the live rows, once
            if rows is not None:
                y, rows = y.index_select(0, rows), None
            y, live = balance.rebalance(y, live)
            if trace is not None:
                trace[-1]["balanced"] = {"before": balance.before, "after": balance.after}
            pending = False
        settled = settle and not lost and stop - done >= SETTLE_MIN_CHAIN
        if settled:
            chain = layers
        elif not single:
            chains += 1
            chain = min(MAX_CHAIN, first if chains < 2 else chain * 2)
        done = stop
    return live.cpu()


def emulate_tiled(
    y: torch.Tensor,
    ell_idx: torch.Tensor,
    ell_val: torch.Tensor,
    bias: float,
    cap: float,
    out_pos: torch.Tensor | None = None,
    tile_inputs: int = TILE_INPUTS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch emulation of ``prunekit_spdnn::tiled`` (same blocked layout, padding, stamps, tile skipping and
    output order).

    Runs on any device; the CPU tests check its index math against the float64 reference. Buffers the kernel
    leaves unwritten (skipped tiles) are filled with NaN here, so a stale value that leaked into a result would
    show.

    Args:
        y: ``(batch, N)`` float32. ell_idx / ell_val: ``(layers, slots, N)``.
        out_pos: ``(layers, N)`` int32 or None: ELL column j computes output ``out_pos[layer, j]``.

    Returns:
        ``(out (batch, N) float32, alive (batch,) int32)`` like the CUDA op.
    """
    bt = tile_inputs
    batch, n = y.shape
    layers = ell_idx.shape[0]
    tiles = (batch + bt - 1) // bt
    a = torch.empty(tiles, n, bt, dtype=torch.float32, device=y.device)
    full, rem = batch // bt, batch % bt
    if full:
        a[:full].copy_(y[: full * bt].reshape(full, bt, n).transpose(1, 2))
    if rem:
        a[full].zero_()
        a[full, :, :rem].copy_(y[full * bt :].t())
    b = torch.full_like(a, float("nan"))
    stamp = torch.zeros(batch, dtype=torch.int32, device=y.device)
    for layer in range(layers):
        padded = torch.full((tiles * bt,), -1, dtype=torch.int32, device=y.device)
        padded[:batch] = stamp
        tile_live = (padded.view(tiles, bt) >= layer).any(dim=1)  # the block's __syncthreads_or
        idx, val = ell_idx[layer].long(), ell_val[layer].float()
        for t in torch.nonzero(tile_live).flatten().tolist():
            acc = torch.zeros(n, bt, dtype=torch.float32, device=y.device)
            for k in range(idx.shape[0]):
                acc = acc + val[k][:, None] * a[t][idx[k]]  # x[(t * n + i) * BT + b], i = idx[k, j]
            z = torch.where(acc != 0, acc + bias, torch.zeros_like(acc)).clamp(0.0, cap)
            if out_pos is None:
                b[t] = z
            else:
                b[t][out_pos[layer].long()] = z
            nonzero = (z != 0).any(dim=0)  # (bt,)
            for e in range(bt):
                g = t * bt + e
                if g < batch and bool(nonzero[e]) and int(stamp[g]) <= layer:
                    stamp[g] = layer + 1
        a, b = b, a
    alive = (stamp == layers).to(torch.int32)
    out = a.transpose(1, 2).reshape(tiles * bt, n)[:batch].clone()
    out[alive == 0] = 0.0
    return out, alive
