from __future__ import annotations

import pytest
import torch

from prunekit.kernels.spdnn_cuda import to_ell
from prunekit.spdnn import slot_order
from prunekit.spdnn.generator import SPDNN_WEIGHT, iter_layers
from prunekit.spdnn.slot_order import (
    apply_row_positions,
    balanced_row_positions,
    bank_conflict_factor,
    bank_conflict_factors,
    order_slots_for_banks,
)


def _random_ell(shape: tuple[int, ...], neurons: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, neurons, shape, generator=g, dtype=torch.int32)
    val = torch.randn(shape, generator=g)
    val[..., -3:, ::5] = 0.0  # some padding slots
    idx[..., -3:, ::5] = 0
    return idx, val


def _sorted_pairs(idx: torch.Tensor, val: torch.Tensor) -> torch.Tensor:
    """Per (layer, column): its (index, value) pairs in sorted order, ``(..., N, slots, 2)`` float64."""
    col_idx, col_val = idx.transpose(-2, -1), val.transpose(-2, -1)
    by_val = torch.argsort(col_val, dim=-1, stable=True)
    col_idx, col_val = torch.gather(col_idx, -1, by_val), torch.gather(col_val, -1, by_val)
    by_idx = torch.argsort(col_idx, dim=-1, stable=True)
    return torch.stack([torch.gather(col_idx, -1, by_idx).double(), torch.gather(col_val, -1, by_idx).double()], -1)


def _generator_ell(neurons: int, layers: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx, val = [], []
    for layer in iter_layers(neurons, layers):
        offsets, inputs = layer.csr_by_output()
        e_idx, e_val = to_ell(offsets, inputs, torch.full((inputs.numel(),), SPDNN_WEIGHT))
        idx.append(e_idx)
        val.append(e_val)
    return torch.stack(idx), torch.stack(val)


@pytest.mark.parametrize("shape", [(32, 64), (3, 32, 64), (7, 40), (2, 5, 43), (1, 3), (0, 16), (2, 4, 0)])
def test_every_column_keeps_its_pairs_and_shape_and_dtype(shape):
    idx, val = _random_ell(shape, neurons=97)
    new_idx, new_val = order_slots_for_banks(idx, val)
    assert new_idx.shape == idx.shape and new_val.shape == val.shape
    assert new_idx.dtype == torch.int32 and new_val.dtype == torch.float32
    assert new_idx.data_ptr() != idx.data_ptr() or idx.numel() == 0
    assert torch.equal(_sorted_pairs(new_idx, new_val), _sorted_pairs(idx, val))


def test_pairs_stay_together_when_values_identify_them():
    idx, _ = _random_ell((4, 32, 64), neurons=128, seed=3)
    val = idx.float() * 2.0 + 1.0  # a function of the index: any split of a pair breaks the relation
    new_idx, new_val = order_slots_for_banks(idx, val)
    assert torch.equal(new_val, new_idx.float() * 2.0 + 1.0)
    assert not torch.equal(new_idx, idx)


@pytest.mark.parametrize("neurons", [43, 1021])
def test_trailing_incomplete_group_is_unchanged(neurons):
    idx, val = _random_ell((2, 16, neurons), neurons=neurons, seed=1)
    new_idx, new_val = order_slots_for_banks(idx, val)
    tail = neurons - neurons % 8
    assert torch.equal(new_idx[..., tail:], idx[..., tail:])
    assert torch.equal(new_val[..., tail:], val[..., tail:])
    assert torch.equal(_sorted_pairs(new_idx, new_val), _sorted_pairs(idx, val))
    assert bank_conflict_factor(new_idx) < bank_conflict_factor(idx)


def test_three_d_input_orders_each_layer_as_its_own_two_d_input():
    idx, val = _random_ell((3, 32, 72), neurons=200, seed=2)
    new_idx, new_val = order_slots_for_banks(idx, val)
    for k in range(3):
        layer_idx, layer_val = order_slots_for_banks(idx[k], val[k])
        assert torch.equal(new_idx[k], layer_idx) and torch.equal(new_val[k], layer_val)


def test_order_is_deterministic():
    idx, val = _random_ell((2, 32, 256), neurons=1024, seed=4)
    first = order_slots_for_banks(idx, val)
    second = order_slots_for_banks(idx.clone(), val.clone())
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


def test_random_layers_drop_from_over_2_3_to_at_most_1_5_wavefronts():
    idx, val = _random_ell((3, 32, 1024), neurons=1024, seed=5)
    before = bank_conflict_factor(idx)
    new_idx, _ = order_slots_for_banks(idx, val)
    after = bank_conflict_factor(new_idx)
    assert before > 2.3
    assert after <= 1.5


def test_generator_layers_do_not_get_worse():
    idx, val = _generator_ell(1024, 12)  # block 1 (consecutive rows) and block 2 (permuted rows)
    new_idx, _ = order_slots_for_banks(idx, val)
    for k in range(idx.shape[0]):
        assert bank_conflict_factor(new_idx[k]) <= bank_conflict_factor(idx[k])
    assert bank_conflict_factor(new_idx[:6]) == 1.0


def test_float64_product_is_exactly_unchanged_with_equal_power_of_two_weights():
    idx, val = _generator_ell(1024, 8)
    new_idx, new_val = order_slots_for_banks(idx, val)
    g = torch.Generator().manual_seed(6)
    x = torch.randint(0, 33, (5, 1024), generator=g).double()  # integers: every partial sum is exact

    def product(ell_idx: torch.Tensor, ell_val: torch.Tensor) -> torch.Tensor:
        y = torch.zeros(ell_idx.shape[0], 5, 1024, dtype=torch.float64)
        for k in range(ell_idx.shape[1]):
            y += ell_val[:, k].double()[:, None, :] * x[:, ell_idx[:, k].long()].permute(1, 0, 2)
        return y

    assert not torch.equal(new_idx, idx)
    assert torch.equal(product(new_idx, new_val), product(idx, val))


def test_mismatched_inputs_raise_value_error():
    idx, val = _random_ell((4, 16), neurons=16)
    with pytest.raises(ValueError, match="same shape"):
        order_slots_for_banks(idx, val[:, :8])
    with pytest.raises(ValueError, match="int32"):
        order_slots_for_banks(idx.long(), val)
    with pytest.raises(ValueError, match="float32"):
        order_slots_for_banks(idx, val.double())
    with pytest.raises(ValueError, match=r"\(slots, N\)"):
        order_slots_for_banks(idx.flatten(), val.flatten())
    with pytest.raises(ValueError, match="integer"):
        bank_conflict_factor(val)


def test_conflict_factor_is_one_for_consecutive_rows_and_lanes_for_one_row():
    consecutive = torch.arange(64, dtype=torch.int32).repeat(4, 1)
    assert bank_conflict_factor(consecutive) == 1.0
    assert bank_conflict_factor(torch.zeros(4, 64, dtype=torch.int32)) == 8.0
    assert bank_conflict_factor(torch.zeros(4, 7, dtype=torch.int32)) == 1.0  # no complete group


def test_build_ell_orders_slots_unless_the_environment_turns_it_off(monkeypatch):
    from prunekit.spdnn.run import SLOT_ORDER_ENV, build_ell

    monkeypatch.delenv(SLOT_ORDER_ENV, raising=False)
    ordered, ordered_val, total = build_ell(iter_layers(1024, 8), 8, 1024, "cpu")
    monkeypatch.setenv(SLOT_ORDER_ENV, "0")
    plain, plain_val, plain_total = build_ell(iter_layers(1024, 8), 8, 1024, "cpu")
    expected_idx, expected_val = _generator_ell(1024, 8)
    assert torch.equal(plain, expected_idx) and torch.equal(plain_val, expected_val)
    assert total == plain_total
    assert torch.equal(ordered, order_slots_for_banks(expected_idx, expected_val)[0])
    assert bank_conflict_factor(ordered) < bank_conflict_factor(plain)


def _distinct_ell(layers: int, neurons: int, slots: int = 32, seed: int = 0) -> torch.Tensor:
    """Random layers whose outputs each read ``slots`` distinct input neurons: ``(layers, slots, N)`` int32."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.rand(layers, neurons, neurons, generator=g)
    return keys.argsort(dim=1)[:, :slots].to(torch.int32)


def _degree_cost(ell_idx: torch.Tensor, row_pos: torch.Tensor, lanes: int = 8, banks: int = 8) -> torch.Tensor:
    """Per layer: sum over complete groups and colors of (entries of that color - mean)^2, colors row_pos % banks."""
    layers, slots, n = ell_idx.shape
    full = n - n % lanes
    colors = torch.gather(row_pos.long(), 1, ell_idx[..., :full].long().flatten(1)).view(layers, slots, full) % banks
    groups = (torch.arange(full) // lanes).expand(layers, slots, full)
    cells = torch.zeros(layers, (full // lanes) * banks, dtype=torch.float64)
    cells.scatter_add_(1, (groups * banks + colors).flatten(1), torch.ones(layers, slots * full, dtype=torch.float64))
    return ((cells - slots * lanes / banks) ** 2).sum(1)


@pytest.mark.parametrize(
    ("shape", "lanes", "banks"),
    [
        ((3, 32, 256), 8, 8),
        ((2, 7, 96), 8, 8),
        ((2, 7, 96), 5, 6),
        ((1, 12, 240), 7, 3),
        ((4, 16), 8, 8),
        ((2, 3, 8), 8, 8),
    ],
)
def test_row_positions_are_permutations_with_n_over_banks_rows_of_each_color(shape, lanes, banks):
    idx, _ = _random_ell(shape, neurons=shape[-1], seed=7)
    row_pos = balanced_row_positions(idx, lanes=lanes, banks=banks, rounds=20)
    assert row_pos.shape == (*shape[:-2], shape[-1]) and row_pos.dtype == torch.int32
    per_layer = row_pos.reshape(-1, shape[-1]).long()
    for rows in per_layer:
        assert torch.equal(rows.sort().values, torch.arange(shape[-1]))
        assert torch.equal(torch.bincount(rows % banks, minlength=banks), torch.full((banks,), shape[-1] // banks))


@pytest.mark.parametrize(("lanes", "banks"), [(8, 8), (5, 6), (8, 3), (4, 2)])
def test_degree_cost_never_increases_over_rounds(lanes, banks):
    idx, _ = _random_ell((3, 12, 240), neurons=240, seed=8)
    # rounds=r stops a longer run after its first r rounds: the costs trace one run.
    costs = [
        _degree_cost(idx, balanced_row_positions(idx, lanes, banks, rounds=r), lanes, banks) for r in (0, 1, 3, 10)
    ]
    identity = _degree_cost(idx, torch.arange(240).expand(3, 240), lanes, banks)
    assert (costs[0] <= identity).all()  # the start: the seeded permutation or the identity, whichever is flatter
    for earlier, later in zip(costs, costs[1:]):
        assert (later <= earlier).all()
    assert (costs[-1] < costs[0]).all()


def test_random_layers_get_flat_degrees_and_at_most_1_2_wavefronts():
    idx = _distinct_ell(3, 1024, seed=9)
    val = torch.full(idx.shape, SPDNN_WEIGHT)
    row_pos = balanced_row_positions(idx)
    start = _degree_cost(idx, balanced_row_positions(idx, rounds=0))
    after = _degree_cost(idx, row_pos)
    assert (after < 0.1 * start).all()
    plain = bank_conflict_factor(order_slots_for_banks(idx, val)[0])
    balanced = bank_conflict_factor(order_slots_for_banks(apply_row_positions(idx, row_pos), val)[0])
    assert plain > 1.3 and balanced <= 1.2


def test_generator_first_block_keeps_its_own_rows():
    idx, val = _generator_ell(1024, 6)  # consecutive rows: every group's colors are already flat
    row_pos = balanced_row_positions(idx)
    assert torch.equal(row_pos, torch.arange(1024, dtype=torch.int32).expand(6, 1024))
    assert bank_conflict_factor(order_slots_for_banks(apply_row_positions(idx, row_pos), val)[0]) == 1.0


def test_row_positions_are_deterministic_and_independent_of_the_other_layers(monkeypatch):
    idx, _ = _random_ell((4, 16, 256), neurons=256, seed=10)
    first = balanced_row_positions(idx, rounds=30, seed=3)
    assert torch.equal(first, balanced_row_positions(idx.clone(), rounds=30, seed=3))
    assert not torch.equal(first, balanced_row_positions(idx, rounds=30, seed=4))
    for k in range(4):
        assert torch.equal(first[k], balanced_row_positions(idx[k], rounds=30, seed=3))
    monkeypatch.setattr(slot_order, "_INCIDENCE_CHUNK", 1)  # one layer per chunk
    assert torch.equal(first, balanced_row_positions(idx, rounds=30, seed=3))


@pytest.mark.cuda
def test_row_positions_are_the_same_on_cuda_and_cpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    idx = _distinct_ell(2, 1024, seed=11)
    cpu = balanced_row_positions(idx, rounds=40)
    assert torch.equal(balanced_row_positions(idx.cuda(), rounds=40).cpu(), cpu)


@pytest.mark.parametrize("shape", [(3, 32, 256), (32, 64), (2, 5, 43)])
def test_apply_row_positions_is_a_gather_that_keeps_the_product(shape):
    idx, val = _random_ell(shape, neurons=shape[-1], seed=12)
    layers = idx.reshape(-1, *shape[-2:]).shape[0]
    g = torch.Generator().manual_seed(13)
    row_pos = torch.stack([torch.randperm(shape[-1], generator=g) for _ in range(layers)]).to(torch.int32)
    row_pos = row_pos.view(*shape[:-2], shape[-1])
    rows = apply_row_positions(idx, row_pos)
    assert rows.shape == idx.shape and rows.dtype == torch.int32
    idx3, val3, rows3, pos2 = (
        idx.view(layers, *shape[-2:]),
        val.view(layers, *shape[-2:]),
        rows.view(layers, *shape[-2:]),
        row_pos.view(layers, -1),
    )
    x = torch.randn(5, shape[-1], generator=g, dtype=torch.float64)
    for k in range(layers):
        assert torch.equal(rows3[k], pos2[k][idx3[k].long()])
        x_rows = torch.empty_like(x)
        x_rows[:, pos2[k].long()] = x
        by_rows = (val3[k].double()[None] * x_rows[:, rows3[k].long()]).sum(1)
        by_neurons = (val3[k].double()[None] * x[:, idx3[k].long()]).sum(1)
        assert torch.equal(by_rows, by_neurons)


def test_per_layer_factors_average_to_the_factor():
    idx, val = _random_ell((5, 32, 200), neurons=200, seed=14)
    idx = order_slots_for_banks(idx, val)[0]
    factors = bank_conflict_factors(idx)
    assert factors.shape == (5,) and factors.dtype == torch.float64
    assert float(factors.mean()) == bank_conflict_factor(idx)
    for k in range(5):
        assert torch.equal(factors[k : k + 1], bank_conflict_factors(idx[k]))
        assert float(factors[k]) == pytest.approx(bank_conflict_factor(idx[k]), abs=1e-12)
    assert torch.equal(
        bank_conflict_factors(torch.zeros(2, 4, 7, dtype=torch.int32)), torch.ones(2, dtype=torch.float64)
    )
    assert bank_conflict_factor(torch.zeros(0, 4, 16, dtype=torch.int32)) == 1.0


def test_row_position_errors_name_the_problem():
    idx, _ = _random_ell((2, 4, 16), neurons=16)
    with pytest.raises(ValueError, match="multiple of banks"):
        balanced_row_positions(idx[..., :12], banks=8)
    with pytest.raises(ValueError, match="int32"):
        balanced_row_positions(idx.long())
    with pytest.raises(ValueError, match=r"\(slots, N\)"):
        balanced_row_positions(idx.flatten())
    with pytest.raises(ValueError, match="0..15"):
        balanced_row_positions(idx + 16)
    with pytest.raises(ValueError, match="rounds"):
        balanced_row_positions(idx, rounds=-1)
    with pytest.raises(ValueError, match=">= 1"):
        balanced_row_positions(idx, lanes=0)
    row_pos = balanced_row_positions(idx, rounds=2)
    with pytest.raises(ValueError, match="shape"):
        apply_row_positions(idx, row_pos[:1])
    with pytest.raises(ValueError, match="shape"):
        apply_row_positions(idx, row_pos[:, :8])
    with pytest.raises(ValueError, match="integer"):
        apply_row_positions(idx, row_pos.float())
    with pytest.raises(ValueError, match="int32"):
        apply_row_positions(idx.long(), row_pos)
    with pytest.raises(ValueError, match="0..15"):
        apply_row_positions(idx - 1, row_pos)
    with pytest.raises(ValueError, match="integer"):
        bank_conflict_factors(idx.float())


def test_chain_layout_keeps_every_layer_s_function_and_never_raises_its_conflict_factor():
    from prunekit.spdnn.generator import relabel
    from prunekit.spdnn.slot_order import bank_conflict_factors, chain_layout

    layers = list(relabel(iter_layers(1024, 8), seed=1))
    plain = [
        to_ell(*layer.csr_by_output(), torch.rand(layer.nnz, generator=torch.Generator().manual_seed(k)))
        for k, layer in enumerate(layers)
    ]
    idx, val = torch.stack([p[0] for p in plain]), torch.stack([p[1] for p in plain])
    new_idx, new_val, row_pos = chain_layout(idx, val)
    assert new_idx.dtype == torch.int32 and row_pos.shape == (8, 1024)
    assert torch.equal(row_pos.sort(dim=1).values, torch.arange(1024, dtype=torch.int32).expand(8, 1024))
    x = torch.rand(5, 1024, dtype=torch.float64)
    for k in range(8):
        rows = torch.empty_like(x)
        rows[:, row_pos[k].long()] = x  # the kernel's shared memory: neuron i in row row_pos[k, i]
        want = (val[k].double()[None] * x[:, idx[k].long()]).sum(1)
        got = (new_val[k].double()[None] * rows[:, new_idx[k].long()]).sum(1)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    ordered = order_slots_for_banks(idx, val)[0]
    assert bool((bank_conflict_factors(new_idx) <= bank_conflict_factors(ordered)).all())
    assert bank_conflict_factor(new_idx) < 1.25 < bank_conflict_factor(ordered)


@pytest.mark.parametrize("mode", ["0", "slots", "1"])
def test_build_chain_layers_modes(mode, monkeypatch):
    from prunekit.spdnn.run import SLOT_ORDER_ENV, build_chain_layers

    monkeypatch.setenv(SLOT_ORDER_ENV, mode)
    idx, val, total, row_pos, packed = build_chain_layers(iter_layers(256, 6), 6, 256, "cpu")
    assert packed is not None and torch.equal(packed & 0xFFFF, idx)  # the challenge's 1/16 is a float16
    plain_idx, plain_val = _generator_ell(256, 6)
    assert total == 6 * 256 * 32 and idx.shape == plain_idx.shape
    if mode == "0":
        assert row_pos is None and torch.equal(idx, plain_idx)
    elif mode == "slots":
        assert row_pos is None and torch.equal(idx, order_slots_for_banks(plain_idx, plain_val)[0])
    else:
        assert row_pos is not None and row_pos.shape == (6, 256)
