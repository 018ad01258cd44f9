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

The kernel may also keep input neuron i of a layer in another shared-memory row, ``row_pos[i]``:
:func:`balanced_row_positions` chooses the rows so that every group reads each bank group about equally often, which
leaves the slot order fewer conflicts it cannot avoid (random layers ~1.36 -> ~1.16), and :func:`apply_row_positions`
rewrites the ELL to name rows.
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
    factors = bank_conflict_factors(ell_idx, lanes, banks)
    return float(factors.mean()) if factors.numel() else 1.0


def bank_conflict_factors(
    ell_idx: torch.Tensor, lanes: int = SLOT_ORDER_LANES, banks: int = SLOT_ORDER_BANKS
) -> torch.Tensor:
    """Per layer, the mean over complete groups of ``lanes`` outputs and slots of the largest number of the group's
    lanes whose index at that slot has the same color ``index % banks`` (see :func:`bank_conflict_factor`).

    Args:
        ell_idx: ``(slots, N)`` or ``(layers, slots, N)`` integer indices.

    Returns:
        ``(layers,)`` float64 on ``ell_idx``'s device (``(1,)`` for 2-D input); 1.0 for a layer without a complete
        group or a slot.

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
    layers = idx3.shape[0]
    colors = torch.remainder(_groups(idx3, lanes).long(), banks).transpose(1, 2)  # (layers * G, slots, lanes)
    if colors.numel() == 0:
        return torch.ones(layers, dtype=torch.float64, device=ell_idx.device)
    counts = torch.zeros(*colors.shape[:2], banks, dtype=torch.int32, device=colors.device)
    counts.scatter_add_(2, colors, torch.ones_like(colors, dtype=torch.int32))
    return counts.amax(2).reshape(layers, -1).double().mean(1)


# Row positions. The slot order can only share out each group's entries of a color among its slots; a group whose
# entries are 40 of one color and 24 of another (of 32 slots x 8 lanes = 256, 32 per color on average) keeps
# conflicts at some slots whatever the order. With the rows permuted, color = row % banks can be chosen per neuron.
BALANCE_ROUNDS = 100  # swap rounds of balanced_row_positions; see its docstring for the measurements
_CANDIDATES_PER_COLOR_PAIR = 16  # neurons per color (and per side of a color pair) considered in each round
_GREEDY_PASSES = 8  # Jacobi passes toward the sequential greedy choice among a round's candidate swaps
_INCIDENCE_CHUNK = 2**26  # incidence elements (layers x N x groups) per chunk of layers: 256 MiB of float32


def _check_rows(ell_idx: torch.Tensor, lanes: int, banks: int) -> None:
    if ell_idx.dim() not in (2, 3):
        raise ValueError(f"ell_idx must be (slots, N) or (layers, slots, N), got shape {tuple(ell_idx.shape)}")
    if ell_idx.dtype != torch.int32:
        raise ValueError(f"ell_idx must be int32, got {ell_idx.dtype}")
    if lanes < 1 or banks < 1:
        raise ValueError(f"lanes and banks must be >= 1, got lanes={lanes} and banks={banks}")
    n = ell_idx.shape[-1]
    if n % banks:
        raise ValueError(f"N = {n} (ell_idx's last dimension) must be a multiple of banks = {banks}")
    if ell_idx.numel() and (int(ell_idx.min()) < 0 or int(ell_idx.max()) >= n):
        raise ValueError(f"ell_idx must name input neurons 0..{n - 1}, got {int(ell_idx.min())}..{int(ell_idx.max())}")


def _degrees(
    entries: torch.Tensor, members: torch.Tensor, per_color: int, groups: int, banks: int, dtype: torch.dtype
) -> torch.Tensor:
    """``entries (L, slots, full)`` neurons of the complete groups, ``members (L, N)`` -> ``(L, groups, banks)``: the
    entries of each group whose neuron has each color (``color = slot // per_color`` in ``members``)."""
    layers, slots, full = entries.shape
    n = members.shape[1]
    slot_color = torch.arange(n, device=members.device).div(per_color, rounding_mode="floor")
    color = torch.empty_like(members).scatter_(1, members, slot_color.expand(layers, n))
    lanes = full // groups
    entry_group = torch.arange(full, device=members.device).div(lanes, rounding_mode="floor")
    cell = entry_group * banks + color.gather(1, entries.reshape(layers, -1)).view_as(entries)
    degree = torch.zeros(layers, groups * banks, dtype=dtype, device=members.device)
    degree.scatter_add_(
        1, cell.reshape(layers, -1), torch.ones(layers, slots * full, dtype=dtype, device=members.device)
    )
    return degree.view(layers, groups, banks)


def _balance_chunk(idx: torch.Tensor, members: torch.Tensor, matchings: torch.Tensor, lanes: int, banks: int) -> None:
    """Improve ``members (L, N)`` in place: the neuron in each (color, rank) slot ``c * N/banks + k``.

    ``idx (L, slots, N)`` int32 on the same device; ``matchings (rounds, banks)`` a permutation of the colors per
    round, whose consecutive pairs are the color pairs of that round.
    """
    layers, slots, n = idx.shape
    device = idx.device
    groups, per_color, pairs = n // lanes, n // banks, banks // 2
    cand = min(_CANDIDATES_PER_COLOR_PAIR, per_color)
    full = groups * lanes
    entries = idx[..., :full].long()
    entry_group = torch.arange(full, device=device).div(lanes, rounding_mode="floor").expand(slots, full)
    # Every product and sum below is an integer; float32 (or TF32: inputs < 2^11) is exact while they stay < 2^24.
    most = int(torch.bincount(entries.flatten()).max()) if entries.numel() else 0
    exact32 = slots * lanes < 2**11 and 2 * most * slots * lanes < 2**24
    dtype = torch.float32 if exact32 else torch.float64
    # inc[l, i, g]: entries of input neuron i in group g; D[l, g, c]: entries of group g of color c.
    inc = torch.zeros(layers, n * groups, dtype=dtype, device=device)
    ones = torch.ones(layers, slots * full, dtype=dtype, device=device)
    inc.scatter_add_(1, (entries * groups + entry_group).reshape(layers, -1), ones)
    inc = inc.view(layers, n, groups)
    inc_rows = inc.view(layers * n, groups)
    square = (inc * inc).sum(2).double()  # (L, N): |inc_i|^2
    # Start from the seeded permutation or from row i for neuron i, whichever has the lower cost (the challenge
    # network's first block reads consecutive rows: its own rows are already flat, cost 0).
    slot = torch.arange(n, device=device)
    identity = torch.empty_like(slot).scatter_(
        0, torch.remainder(slot, banks) * per_color + slot.div(banks, rounding_mode="floor"), slot
    )
    degree = _degrees(entries, members, per_color, groups, banks, dtype)
    own_degree = _degrees(entries, identity.expand(layers, n), per_color, groups, banks, dtype)
    # sum (D - mean)^2 = sum D^2 - (a constant: each group's degrees sum to its entries); integers, exact in float64.
    own = (own_degree.double() ** 2).sum((1, 2)) <= (degree.double() ** 2).sum((1, 2))
    members.copy_(torch.where(own[:, None], identity, members))
    degree = torch.where(own[:, None, None], own_degree, degree)
    if pairs == 0:
        return
    base = (torch.arange(layers, device=device) * n)[:, None, None]
    rank = torch.arange(per_color, device=device)
    steps = torch.arange(cand, device=device)
    before = torch.ones(cand, cand, dtype=torch.bool, device=device).tril(-1)
    for match in matchings:
        low = torch.minimum(match[0 : 2 * pairs : 2], match[1 : 2 * pairs : 2])
        high = torch.maximum(match[0 : 2 * pairs : 2], match[1 : 2 * pairs : 2])
        side, target = torch.cat([low, high]), torch.cat([high, low])  # (2P,): a block's color and where it moves
        block = members.view(layers, banks, per_color)[:, side]  # (L, 2P, K)
        # move: half the cost change of moving a neuron i alone from color c to t, sum_g inc_i (D_t - D_c) + |inc_i|^2.
        s = torch.bmm(inc, degree).view(layers, n * banks)
        s_to = s.gather(1, (block * banks + target[:, None]).view(layers, -1))
        s_from = s.gather(1, (block * banks + side[:, None]).view(layers, -1))
        move = (s_to.double() - s_from.double() + square.gather(1, block.view(layers, -1))).view_as(block)
        best = (move.long() * per_color + rank).topk(cand, dim=2, largest=False).indices  # unique keys: deterministic
        move = move.gather(2, best)
        neuron = block.gather(2, best)
        # Candidate swaps (L, P, C): the r-th best of color low with the r-th best of color high. Swap (a, b) adds
        # d = inc_b - inc_a to D[:, low] and subtracts it from D[:, high]; its exact cost change is
        # 2 <D, delta> + |delta|^2 = 2 (move_a + move_b - |inc_a|^2 - |inc_b|^2 + |d|^2).
        a, b = neuron[:, :pairs], neuron[:, pairs:]
        rows = inc_rows.index_select(0, (neuron + base).flatten()).view(layers, 2 * pairs, cand, groups)
        d = (rows[:, pairs:] - rows[:, :pairs]).reshape(layers * pairs, cand, groups)
        gram = torch.bmm(d, d.transpose(1, 2)).double()  # (L * P, C, C)
        change = 2 * (
            move[:, :pairs]
            + move[:, pairs:]
            - square.gather(1, a.reshape(layers, -1)).view_as(a)
            - square.gather(1, b.reshape(layers, -1)).view_as(b)
        ).reshape(layers * pairs, cand) + 2 * gram.diagonal(dim1=1, dim2=2)
        # Swaps of different color pairs touch different cells; those of one pair interact: accepting a set A of them
        # costs exactly sum_{i in A} change_i + sum_{j < i in A} 4 <d_i, d_j>. Per color pair, in order of change, two
        # exact candidates: the best prefix (possibly empty), and the sequential greedy (take swap i if it still gains
        # given the swaps taken before it) approximated by a few Jacobi passes. The cheaper one is accepted.
        order = torch.argsort(change.long() * cand + steps, dim=1)
        change = change.gather(1, order)
        gram = gram.gather(1, order[:, :, None].expand_as(gram)).gather(2, order[:, None, :].expand_as(gram))
        earlier = 4 * gram.masked_fill_(~before, 0)
        prefix = torch.cat([change.new_zeros(change.shape[0], 1), torch.cumsum(change + earlier.sum(2), dim=1)], 1)
        keep = prefix.argmin(1)  # first minimum; 0 = none
        greedy = (change < 0).double()
        for _ in range(_GREEDY_PASSES):
            greedy = (change + torch.bmm(earlier, greedy[..., None])[..., 0] < 0).double()
        greedy_total = (greedy * (change + torch.bmm(earlier, greedy[..., None])[..., 0])).sum(1)
        use_greedy = greedy_total < prefix.gather(1, keep[:, None])[:, 0]
        accept_sorted = torch.where(use_greedy[:, None], greedy > 0, steps < keep[:, None])
        accept = torch.empty_like(accept_sorted).scatter_(1, order, accept_sorted).view(layers, pairs, cand)
        flat_a = low[:, None] * per_color + best[:, :pairs]
        flat_b = high[:, None] * per_color + best[:, pairs:]
        members.scatter_(1, flat_a.reshape(layers, -1), torch.where(accept, b, a).reshape(layers, -1))
        members.scatter_(1, flat_b.reshape(layers, -1), torch.where(accept, a, b).reshape(layers, -1))
        moved = torch.bmm(accept.view(-1, 1, cand).to(dtype), d).view(layers, pairs, groups).transpose(1, 2)
        degree.scatter_add_(2, low.expand(layers, groups, pairs), moved)
        degree.scatter_add_(2, high.expand(layers, groups, pairs), -moved)


def balanced_row_positions(
    ell_idx: torch.Tensor,
    lanes: int = SLOT_ORDER_LANES,
    banks: int = SLOT_ORDER_BANKS,
    rounds: int = BALANCE_ROUNDS,
    seed: int = 0,
) -> torch.Tensor:
    """A shared-memory row for every input neuron of every layer, chosen so that each group of ``lanes`` outputs
    reads about as many entries of every bank group (color ``row % banks``) as of any other.

    The slot order (:func:`order_slots_for_banks`) then finds distinct colors at more slots. Conflict factor after
    it, row i for neuron i -> these rows (N = 1024, 100 rounds, CPU): random layers 1.36 -> 1.16, the challenge
    network's layers 7-14 1.40 -> 1.14, a relabelled network's layers 1-8 1.47 -> 1.12; its first block stays 1.0.
    A static layout precomputed once at build time, as in PopSparse's static sparsity (Graphcore, "PopSparse:
    Accelerated block sparse matrix multiplication on IPU", 2023).

    Method: each color holds exactly N/banks neurons, starting from the colors of a seeded random permutation (or of
    row i for neuron i where that costs no more: the challenge network's first block is already flat). Swap rounds,
    vectorised over layers, lower the sum over groups and colors of (degree - mean)^2, a group's degree of a color
    being its number of entries of that color. Each round pairs up the colors at random; for each color pair
    (c1, c2), the neurons of c1 that gain most from moving to c2 are paired in order with those of c2 that gain most
    from moving to c1. The candidate swaps' exact cost changes and pairwise interactions (through shared groups) give
    the exact cost of any subset of them; of the best prefix in order of cost change (possibly empty) and an
    approximate sequential greedy choice, the cheaper is accepted, so the cost never increases. The randomness comes
    from a CPU ``torch.Generator`` and the arithmetic is exact (integers), so the rows are the same on every device,
    and a layer's rows do not depend on the other layers given with it.

    Args:
        ell_idx: ``(slots, N)`` or ``(layers, slots, N)`` int32, the input neuron (0..N-1) of each (slot, output).
            Groups as in :func:`order_slots_for_banks` (outputs past the last complete group are ignored).
        lanes: outputs per group (a phase of the kernel's 128-bit shared loads).
        banks: 16-byte bank groups of shared memory.
        rounds: swap rounds (0: the start permutation); a run's first r rounds are those of a run with r rounds and
            the same seed. At N = 1024 the cost settles by ~100 rounds (0.6 s per 64 layers on 2 CPU threads); the
            structured layers of N = 4096 still gain from 50 to 100.
        seed: seeds the start permutation and the rounds' color pairs.

    Returns:
        ``row_pos``: ``(N,)`` or ``(layers, N)`` int32 on ``ell_idx``'s device, each layer a permutation of 0..N-1:
        input neuron i of layer l is kept in row ``row_pos[l, i]``. The neurons of color c take rows c, c + banks,
        c + 2 * banks, ... Time and memory grow with layers x N x N / lanes (a dense incidence matrix, float32 or, if
        its products could reach 2^24, float64; built in chunks of layers).

    Raises:
        ValueError: ``ell_idx`` not 2-D or 3-D or not int32, an index outside 0..N-1, N not a multiple of
            ``banks``, ``lanes`` / ``banks`` < 1, or ``rounds`` < 0.
    """
    _check_rows(ell_idx, lanes, banks)
    if rounds < 0:
        raise ValueError(f"rounds must be >= 0, got {rounds}")
    squeeze = ell_idx.dim() == 2
    idx3 = ell_idx.unsqueeze(0) if squeeze else ell_idx
    layers, slots, n = idx3.shape
    device = idx3.device
    per_color = n // banks
    generator = torch.Generator().manual_seed(seed)
    start_rows = torch.randperm(n, generator=generator)
    matchings = torch.argsort(torch.rand(rounds, banks, generator=generator), dim=1).to(device)
    # members[l, c * K + k] (K = N / banks): the neuron in row c + banks * k.
    slot_of_row = (start_rows % banks) * per_color + start_rows.div(banks, rounding_mode="floor")
    start = torch.empty(n, dtype=torch.int64).scatter_(0, slot_of_row, torch.arange(n))
    members = start.to(device).expand(layers, n).clone()
    groups = n // lanes
    if slots and groups:
        step = max(1, _INCIDENCE_CHUNK // (n * groups))
        for lo in range(0, layers, step):
            part = members[lo : lo + step]
            _balance_chunk(idx3[lo : lo + step], part, matchings, lanes, banks)
    slot = torch.arange(n, device=device)
    row = slot.div(max(per_color, 1), rounding_mode="floor") + banks * torch.remainder(slot, max(per_color, 1))
    row_pos = torch.empty(layers, n, dtype=torch.int32, device=device)
    row_pos.scatter_(1, members, row.to(torch.int32).expand(layers, n))
    return row_pos[0] if squeeze else row_pos


def apply_row_positions(ell_idx: torch.Tensor, row_pos: torch.Tensor) -> torch.Tensor:
    """The ELL with every input neuron i of layer l replaced by its shared-memory row ``row_pos[l, i]`` (a gather).

    With the features stored by row (``x_rows[:, row_pos[l]] = x``), the kernel's products over the new indices equal
    the products over the old ones.

    Args:
        ell_idx: ``(slots, N)`` or ``(layers, slots, N)`` int32 input neurons 0..N-1.
        row_pos: ``(N,)`` or ``(layers, N)`` integer (as from :func:`balanced_row_positions`), same device.

    Returns:
        ``ell_idx``'s shape, int32.

    Raises:
        ValueError: ``ell_idx`` not 2-D or 3-D or not int32, ``row_pos`` not ``ell_idx``'s layers x N or not an
            integer dtype, different devices, or an index outside 0..N-1.
    """
    if ell_idx.dim() not in (2, 3):
        raise ValueError(f"ell_idx must be (slots, N) or (layers, slots, N), got shape {tuple(ell_idx.shape)}")
    if ell_idx.dtype != torch.int32:
        raise ValueError(f"ell_idx must be int32, got {ell_idx.dtype}")
    expected = (*ell_idx.shape[:-2], ell_idx.shape[-1])
    if tuple(row_pos.shape) != expected:
        raise ValueError(
            f"row_pos must have shape {expected} for ell_idx {tuple(ell_idx.shape)}, got {tuple(row_pos.shape)}"
        )
    if row_pos.dtype.is_floating_point or row_pos.dtype.is_complex or row_pos.dtype == torch.bool:
        raise ValueError(f"row_pos must have an integer dtype, got {row_pos.dtype}")
    if row_pos.device != ell_idx.device:
        raise ValueError(f"ell_idx and row_pos must be on the same device, got {ell_idx.device} and {row_pos.device}")
    n = ell_idx.shape[-1]
    if ell_idx.numel() and (int(ell_idx.min()) < 0 or int(ell_idx.max()) >= n):
        raise ValueError(f"ell_idx must name input neurons 0..{n - 1}, got {int(ell_idx.min())}..{int(ell_idx.max())}")
    flat = ell_idx.long().flatten(-2)  # (..., slots * N)
    return torch.gather(row_pos.long(), -1, flat).view(ell_idx.shape).to(torch.int32)


def chain_layout(
    ell_idx: torch.Tensor,
    ell_val: torch.Tensor,
    lanes: int = SLOT_ORDER_LANES,
    banks: int = SLOT_ORDER_BANKS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chain kernel's static layout of layers: per layer, the shared-memory row of every input neuron and the order
    of every output's slots, the better (by :func:`bank_conflict_factors`) of two candidates:

    - identity rows (neuron i in row i) with :func:`order_slots_for_banks` — best where the numbering already spreads
      the reads (the challenge generator's first layers: 1.0);
    - :func:`balanced_row_positions` (each group's reads spread evenly over the bank groups), then
      :func:`order_slots_for_banks` — best for randomly numbered neurons (a relabelled network: ~2.6 -> ~1.2).

    Args:
        ell_idx: ``(layers, slots, N)`` int32 input neurons (any slot order). ell_val: the same shape, float32.

    Returns:
        ``(idx, val, row_pos)``: ``idx (layers, slots, N)`` int32 naming shared-memory rows, ``val`` float32 (each
        output's pairs permuted among its slots), ``row_pos (layers, N)`` int32 (row of each input neuron, a
        permutation per layer); the chain op takes ``idx``, ``val`` and ``row_pos`` together.

    Raises:
        ValueError: as :func:`order_slots_for_banks` and :func:`balanced_row_positions`.
    """
    layers, _, n = ell_idx.shape
    plain_idx, plain_val = order_slots_for_banks(ell_idx, ell_val, lanes, banks)
    row_pos = balanced_row_positions(ell_idx, lanes, banks)
    moved_idx, moved_val = order_slots_for_banks(apply_row_positions(ell_idx, row_pos), ell_val, lanes, banks)
    take = bank_conflict_factors(moved_idx, lanes, banks) < bank_conflict_factors(plain_idx, lanes, banks)
    take = take.to(ell_idx.device)
    identity = torch.arange(n, dtype=torch.int32, device=ell_idx.device).expand(layers, n)
    row_pos = torch.where(take[:, None], row_pos, identity)
    idx = torch.where(take[:, None, None], moved_idx, plain_idx)
    val = torch.where(take[:, None, None], moved_val, plain_val)
    return idx, val, row_pos
