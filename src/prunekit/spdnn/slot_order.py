"""Reorder each output's ELL slots so that the chain kernel's float4 feature reads avoid shared-memory bank conflicts.

The chain kernel (``kernels/csrc/spdnn/spdnn_chain.cu``) keeps the features in shared memory, one row per input
neuron i, and each thread handles an output neuron j; at ELL slot k, lane j reads the row of input neuron
``ell_idx[k, j]`` as 16-byte float4 loads. A 128-bit shared load is served in 4 phases of 8 consecutive lanes
(outputs 8q .. 8q+7), and row i lands in the 16-byte bank group ``i mod 8`` (up to a fixed bijection: the row
stride is an odd number of 16-byte units, or 1). Two lanes of a phase that read rows of the same group cost an
extra wavefront. The challenge generator's first layers read consecutive rows (conflict-free), but randomly
numbered neurons (later blocks, or a relabelled network) average ~2.6 wavefronts per phase.

An output's sum over its slots may be taken in any order, so its (index, weight) pairs can be permuted among its
slots at build time: a static schedule precomputed once, as in PopSparse's static sparsity (Graphcore, "PopSparse:
Accelerated block sparse matrix multiplication on IPU", 2023). :func:`order_slots_for_banks` does this greedily,
slot by slot, per aligned group of 8 outputs (mean max group multiplicity per slot 2.6 -> ~1.36 on random
indices; the lower bound is ~1.23); :func:`bank_conflict_factor` measures the result.
"""

from __future__ import annotations

import torch

SLOT_ORDER_LANES = 8  # lanes per phase of a 128-bit shared-memory load (32 lanes in 4 phases of 8)
SLOT_ORDER_BANKS = 8  # 16-byte bank groups: 32 four-byte banks / 4
# Greedy score weights (lower wins): a color already used at this slot by another lane of the group first
# (conflict), then the color with the most entries left in the whole group (keeps the later slots balanced),
# then the one with the most entries left in this lane. Tuned in a numpy simulation of random indices.
_CONFLICT_WEIGHT = 100000
_GROUP_LEFT_WEIGHT = 1
_LANE_LEFT_WEIGHT = 10
_UNAVAILABLE = 2**30  # score of a color the lane has no entry of left (int32)


def _check(ell_idx: torch.Tensor, ell_val: torch.Tensor, lanes: int, banks: int) -> None:
    if ell_idx.dim() not in (2, 3):
        raise ValueError(f"ell_idx must be (slots, N) or (layers, slots, N), got shape {tuple(ell_idx.shape)}")
    if ell_idx.shape != ell_val.shape:
        raise ValueError(
            f"ell_idx and ell_val must have the same shape, got {tuple(ell_idx.shape)} and {tuple(ell_val.shape)}"
        )
    if ell_idx.dtype != torch.int32 or ell_val.dtype != torch.float32:
        raise ValueError(f"ell_idx must be int32 and ell_val float32, got {ell_idx.dtype} and {ell_val.dtype}")
    if ell_idx.device != ell_val.device:
        raise ValueError(f"ell_idx and ell_val must be on the same device, got {ell_idx.device} and {ell_val.device}")
    if lanes < 1 or banks < 1:
        raise ValueError(f"lanes and banks must be >= 1, got lanes={lanes} and banks={banks}")


def _groups(ell: torch.Tensor, lanes: int) -> torch.Tensor:
    """``(layers, slots, N)`` -> ``(layers * N // lanes, lanes, slots)``: the complete groups of ``lanes`` outputs."""
    layers, slots, n = ell.shape
    full = n - n % lanes
    return ell[..., :full].reshape(layers, slots, full // lanes, lanes).permute(0, 2, 3, 1).reshape(-1, lanes, slots)


def _ungroup(groups: torch.Tensor, layers: int, slots: int) -> torch.Tensor:
    """Inverse of :func:`_groups`: ``(layers * G, lanes, slots)`` -> ``(layers, slots, G * lanes)``."""
    _, lanes, _ = groups.shape
    return groups.reshape(layers, -1, lanes, slots).permute(0, 3, 1, 2).reshape(layers, slots, -1)


def _greedy_colors(colors: torch.Tensor, banks: int) -> torch.Tensor:
    """The greedy color sequence of every lane: ``colors (G, lanes, slots)`` int64 -> same shape, each lane's row a
    permutation of its input row."""
    groups, lanes, slots = colors.shape
    device = colors.device
    rem = torch.zeros(groups, lanes, banks, dtype=torch.int32, device=device)
    rem.scatter_add_(2, colors, torch.ones_like(colors, dtype=torch.int32))
    lane_ids = torch.arange(lanes, device=device)
    ones = torch.ones(groups, 1, dtype=torch.int32, device=device)
    chosen = torch.empty(groups, lanes, dtype=torch.int64, device=device)
    out = torch.empty(groups, lanes, slots, dtype=torch.int64, device=device)
    for s in range(slots):
        cnt = torch.zeros(groups, banks, dtype=torch.int32, device=device)
        base = -_GROUP_LEFT_WEIGHT * rem.sum(1, dtype=torch.int32)  # tot, once per slot
        flexibility = (rem > 0).sum(2)
        order = torch.argsort(flexibility * lanes + lane_ids, dim=1)  # ascending, ties by lane number
        rem_ordered = torch.gather(rem, 1, order[:, :, None].expand(groups, lanes, banks))
        for p in range(lanes):
            lane_rem = rem_ordered[:, p]
            score = base + _CONFLICT_WEIGHT * cnt - _LANE_LEFT_WEIGHT * lane_rem
            score.masked_fill_(lane_rem == 0, _UNAVAILABLE)
            pick = score.argmin(1, keepdim=True)  # first minimum: deterministic
            lane_rem.scatter_add_(1, pick, -ones)
            cnt.scatter_add_(1, pick, ones)
            chosen[:, p] = pick[:, 0]
        rem.scatter_(1, order[:, :, None].expand(groups, lanes, banks), rem_ordered)
        out[:, :, s].scatter_(1, order, chosen)
    return out


def order_slots_for_banks(
    ell_idx: torch.Tensor,
    ell_val: torch.Tensor,
    lanes: int = SLOT_ORDER_LANES,
    banks: int = SLOT_ORDER_BANKS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Permute every output's (index, weight) pairs among its ELL slots so that, at each slot, the ``lanes`` outputs
    of an aligned group read input rows in distinct shared-memory bank groups (``index % banks``) as far as possible.

    Greedy, per group of ``lanes`` consecutive outputs, slot by slot: the lanes with the fewest colors left choose
    first, each the color least used at this slot so far, then the one with the most entries left in the group,
    then in the lane. Each lane's entries of one color keep their original relative order. Deterministic; vectorised
    over groups and layers (``slots * lanes`` steps). Padding slots (weight 0) are ordinary entries.

    Args:
        ell_idx: ``(slots, N)`` or ``(layers, slots, N)`` int32, the input neuron of each (slot, output).
        ell_val: the same shape, float32, on the same device.
        lanes: outputs per group (a phase of the kernel's 128-bit shared loads).
        banks: 16-byte bank groups of shared memory.

    Returns:
        New ``(ell_idx, ell_val)`` of the same shape, dtype and device; column j of each layer holds a permutation of
        the input column's pairs. Outputs past the last complete group (``N % lanes`` of them) are unchanged.

    Raises:
        ValueError: ``ell_idx`` / ``ell_val`` of different shapes or devices, not 2-D or 3-D, not int32 / float32,
            or ``lanes`` / ``banks`` < 1.
    """
    _check(ell_idx, ell_val, lanes, banks)
    squeeze = ell_idx.dim() == 2
    idx3 = ell_idx.unsqueeze(0) if squeeze else ell_idx
    val3 = ell_val.unsqueeze(0) if squeeze else ell_val
    new_idx, new_val = idx3.clone(), val3.clone()
    layers, slots, n = idx3.shape
    full = n - n % lanes
    if slots > 0 and full > 0:
        idx_g = _groups(idx3, lanes)
        val_g = _groups(val3, lanes)
        colors = torch.remainder(idx_g.long(), banks)
        sequence = _greedy_colors(colors, banks)
        # The k-th slot of color c in the new sequence takes the lane's k-th entry of color c: sort both by
        # (color, slot) (keys are unique) and pair them up.
        slot_ids = torch.arange(slots, device=idx3.device)
        source_slots = torch.argsort(colors * slots + slot_ids, dim=2)
        target_slots = torch.argsort(sequence * slots + slot_ids, dim=2)
        source = torch.empty_like(source_slots).scatter_(2, target_slots, source_slots)
        new_idx[..., :full] = _ungroup(torch.gather(idx_g, 2, source), layers, slots)
        new_val[..., :full] = _ungroup(torch.gather(val_g, 2, source), layers, slots)
    if squeeze:
        return new_idx[0], new_val[0]
    return new_idx, new_val


def bank_conflict_factor(ell_idx: torch.Tensor, lanes: int = SLOT_ORDER_LANES, banks: int = SLOT_ORDER_BANKS) -> float:
    """Mean over complete groups of ``lanes`` outputs, slots (and layers) of the largest number of the group's lanes
    whose index at that slot has the same color ``index % banks``: the wavefronts per phase of the chain kernel's
    float4 feature reads. 1.0 is conflict-free, ``lanes`` the worst.

    Args:
        ell_idx: ``(slots, N)`` or ``(layers, slots, N)`` integer indices.

    Returns:
        The mean, or 1.0 when there is no complete group or no slot.

    Raises:
        ValueError: ``ell_idx`` not 2-D or 3-D, not an integer dtype, or ``lanes`` / ``banks`` < 1.
    """
    if ell_idx.dim() not in (2, 3):
        raise ValueError(f"ell_idx must be (slots, N) or (layers, slots, N), got shape {tuple(ell_idx.shape)}")
    if ell_idx.dtype.is_floating_point or ell_idx.dtype.is_complex or ell_idx.dtype == torch.bool:
        raise ValueError(f"ell_idx must have an integer dtype, got {ell_idx.dtype}")
    if lanes < 1 or banks < 1:
        raise ValueError(f"lanes and banks must be >= 1, got lanes={lanes} and banks={banks}")
    idx3 = ell_idx.unsqueeze(0) if ell_idx.dim() == 2 else ell_idx
    colors = torch.remainder(_groups(idx3, lanes).long(), banks).transpose(1, 2)  # (G, slots, lanes)
    if colors.numel() == 0:
        return 1.0
    counts = torch.zeros(*colors.shape[:2], banks, dtype=torch.int32, device=colors.device)
    counts.scatter_add_(2, colors, torch.ones_like(colors, dtype=torch.int32))
    return float(counts.amax(2).double().mean())
