from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from prunekit.cli import app
from prunekit.errors import PrunekitError
from prunekit.spdnn import tsv
from prunekit.spdnn.generator import (
    SPDNN_NNZ_PER_ROW,
    SPDNN_SEED,
    base_layer,
    bias_for,
    check_neurons,
    iter_layers,
    relabel,
    synthetic_image_set,
    synthetic_images,
)
from prunekit.spdnn.ops import spdnn_layer
from prunekit.spdnn.reference import compact_rows_, dense_features, infer, truth_categories
from prunekit.spdnn.run import generate, partition, run_network

N = 256  # n = 16, d = 4: small enough for CPU tests, same recipe as the challenge sizes


def test_every_layer_has_32_nonzeros_per_row_and_column():
    for layer in iter_layers(N, 12):
        assert layer.nnz == N * SPDNN_NNZ_PER_ROW
        assert torch.equal(torch.bincount(layer.rows, minlength=N), torch.full((N,), 32))
        assert torch.equal(torch.bincount(layer.cols, minlength=N), torch.full((N,), 32))
        assert len(set(zip(layer.rows.tolist(), layer.cols.tolist()))) == layer.nnz


@pytest.mark.parametrize("stride", [1, 2, 4, 8])
def test_base_layer_is_kron_of_ones_and_shifted_identity(stride):
    n = N // 16
    e = torch.zeros(n, n)
    for i in range(n):
        for j in range(n):
            if (i - j) % n in (0, stride):
                e[i, j] = 1
    k = torch.kron(torch.ones(16, 16), e)
    rows, cols = base_layer(N, stride)
    dense = torch.zeros(N, N)
    dense[rows, cols] = 1
    assert torch.equal(dense, k)


def test_blocks_of_log2_n_layers_share_one_mt19937_permutation():
    layers = list(iter_layers(N, 12))
    depth = 4
    for k in range(depth):  # block 1: K as is
        assert torch.equal(layers[k].rows, base_layer(N, 2**k)[0])
    rng = np.random.RandomState(SPDNN_SEED)
    for block in (1, 2):
        p = torch.from_numpy(np.argsort(rng.random_sample(N), kind="stable"))
        for offset in range(depth):
            layer = layers[block * depth + offset]
            k_rows, k_cols = base_layer(N, 2**offset)
            expected = torch.zeros(N, N)
            expected[p[k_rows], k_cols] = 1  # W[p[i], :] = K[i, :]
            assert torch.equal(layer.dense(torch.float32) * 16, expected)


def test_network_is_deterministic_and_prefix_stable():
    a = [layer.rows for layer in iter_layers(N, 9)]
    b = [layer.rows for layer in iter_layers(N, 5)]
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_synthetic_images_are_binary_with_the_exact_total():
    images, pixels = synthetic_images(1024, 500)
    assert images.numel() == round(6374505 * 500 / 60000)
    pairs = set(zip(images.tolist(), pixels.tolist()))
    assert len(pairs) == images.numel()  # no duplicate pixel: binary
    assert int(pixels.max()) < 1024 and int(images.max()) == 499
    again = synthetic_images(1024, 500)
    assert torch.equal(again[1], pixels)


def dense_reference(features, layers, bias):
    y = features.clone()
    for layer in layers:
        z = y @ layer.dense()
        z[z != 0] += bias
        y = z.clamp(0, 32)
    return torch.nonzero(y.any(dim=1)).flatten()


def small_inputs(count=300, density=0.25):
    images, pixels = synthetic_images(N, count, total_nnz=int(density * N * count))
    return dense_features(images, pixels, count, N)


def test_sparse_inference_equals_dense_float64_and_finds_categories():
    features = small_inputs()
    net = list(iter_layers(N, 16))
    live = infer(features, net, bias_for(N))
    assert 0 < live.numel() < features.shape[0]
    assert torch.equal(live, dense_reference(features, net, bias_for(N)))
    float32 = infer(features.float(), net, bias_for(N))
    assert torch.equal(float32, live)


def test_spdnn_layer_op_matches_dense_and_passes_opcheck():
    layer = next(iter_layers(N, 1))
    offsets, inputs = layer.csr_by_output()
    values = torch.full((inputs.numel(),), 1 / 16, dtype=torch.float64)
    y = torch.rand(7, N, dtype=torch.float64) * 40
    out = spdnn_layer(y, offsets, inputs, values, -0.3, 32.0)
    z = y @ layer.dense()
    z[z != 0] += -0.3
    torch.testing.assert_close(out, z.clamp(0, 32))
    assert float(out.max()) == 32.0  # the cap is reached with these inputs
    torch.library.opcheck(spdnn_layer, (y.float(), offsets, inputs, values.float(), -0.3, 32.0))


def test_generate_writes_official_layout_and_run_passes(tmp_path):
    result = generate(tmp_path, N, [4, 8], inputs=200)
    assert (tmp_path / f"neuron{N}" / f"n{N}-l8.tsv").is_file()
    assert tsv.images_path(tmp_path, N).is_file()
    layer = tsv.read_layer(tmp_path, N, 6)
    reference = list(iter_layers(N, 6))[-1]
    assert torch.equal(layer.rows, reference.rows) and torch.equal(layer.cols, reference.cols)
    assert tsv.layer_path(tmp_path, N, 1).read_text().splitlines()[0].split("\t")[2] == "0.0625"
    for count in (4, 8):
        truth = tsv.read_categories(tsv.categories_path(tmp_path, N, count))
        assert truth.numel() == result.categories[count]
        run = run_network(N, count, data=tmp_path)
        assert run.passed is True
        assert run.total_nnz == count * N * 32 and run.edges == 200 * count * N * 32


def test_run_fails_on_a_wrong_truth_file(tmp_path):
    generate(tmp_path, N, [4], inputs=100)
    path = tsv.categories_path(tmp_path, N, 4)
    truth = tsv.read_categories(path)
    tsv.write_categories(path, torch.cat([truth, torch.tensor([99])]).unique(), overwrite=True)
    result = CliRunner().invoke(app, ["spdnn", "run", "-n", str(N), "-l", "4", "--data", str(tmp_path)])
    assert result.exit_code == 1
    assert "FAIL" in result.stdout


def test_cli_generate_and_run_synthetic(tmp_path):
    runner = CliRunner()
    result = runner.invoke(app, ["spdnn", "generate", "-o", str(tmp_path), "-n", str(N), "-l", "4", "--inputs", "50"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(
        app,
        ["spdnn", "run", "-n", str(N), "-l", "4", "--synthetic", "--inputs", "50", "--json", str(tmp_path / "r.json")],
    )
    assert result.exit_code == 0, result.output
    assert "PASS" in result.stdout
    bad = runner.invoke(app, ["spdnn", "run", "-n", "1000", "--synthetic"])
    assert bad.exit_code == 1 and "16 x a power of two" in bad.stderr


def test_bad_sizes_and_missing_files_are_one_line_errors(tmp_path):
    with pytest.raises(PrunekitError):
        check_neurons(1000)
    with pytest.raises(PrunekitError, match="missing challenge file"):
        tsv.read_layer(tmp_path, N, 1)


OFFICIAL = os.environ.get("PRUNEKIT_SPDNN_OFFICIAL")


@pytest.mark.skipif(not OFFICIAL, reason="set PRUNEKIT_SPDNN_OFFICIAL to a folder of official n1024-l{k}.mtx files")
def test_generator_matches_official_n1024_files():
    """LAGraph's copy (data/dnn_data) of the official files: layers 1-5 and 7-30 are equal bit for bit;
    its layer 6 holds 16896 of the 32768 entries (a subset of ours; its own layer 12 has all 32768)."""
    for layer in iter_layers(1024, 30):
        path = Path(OFFICIAL) / f"n1024-l{layer.index}.mtx"
        if not path.is_file() or layer.index == 6:
            continue
        data = np.loadtxt(path, comments="%", dtype=np.int64, usecols=(0, 1))[1:] - 1
        rows, cols = torch.from_numpy(data[:, 0]), torch.from_numpy(data[:, 1])
        order = torch.argsort(rows * 1024 + cols)
        assert torch.equal(rows[order], layer.rows) and torch.equal(cols[order], layer.cols)


def test_ell_layout_holds_the_same_layer():
    from prunekit.kernels.spdnn_cuda import to_ell

    layer = list(iter_layers(N, 6))[-1]
    offsets, inputs = layer.csr_by_output()
    values = torch.full((inputs.numel(),), 1 / 16)
    idx, val = to_ell(offsets, inputs, values)
    assert idx.shape == (32, N) and idx.dtype == torch.int32
    rebuilt = torch.zeros(N, N)
    rebuilt.index_put_((idx.long().flatten(), torch.arange(N).repeat(32)), val.flatten(), accumulate=True)
    assert torch.equal(rebuilt, layer.dense(torch.float32))


def test_fused_kernel_needs_cuda_float32():
    with pytest.raises(PrunekitError, match="fused"):
        run_network(N, 4, synthetic=True, inputs=20, kernel="fused")
    with pytest.raises(PrunekitError, match="float32, float16 or bfloat16"):
        run_network(N, 4, synthetic=True, inputs=20, kernel="fused", dtype=torch.float64)
    with pytest.raises(PrunekitError, match="tiled runs on CUDA in float32"):
        run_network(N, 4, synthetic=True, inputs=20, kernel="tiled", dtype=torch.float16)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("neurons", [1024, 4096])
def test_fused_chain_with_16_bit_features_matches_a_float64_model_of_its_rounding(dtype, neurons):
    """The 16-bit option: features stored in float16 / bfloat16 between layers, each layer computed in float32. The
    float64 model rounds to the 16-bit type after every layer, as the kernel does; the kernel's float32 sums differ
    from it by float32 rounding (and the float32 bias), which may move a value across a 16-bit rounding boundary."""

    count = 700
    features, net, idx, val = _cuda_case(neurons, count, 3)
    bias = bias_for(neurons)
    out, alive = torch.ops.prunekit_spdnn.chain(features.to(dtype), idx, val, bias, 32.0)
    assert out.dtype == dtype and out.shape == features.shape
    ref = features.double()
    for layer in net:
        z = ref @ layer.dense()
        ref = torch.where(z != 0, z + bias, z).clamp(0, 32).to(dtype).double()
    ulp = 2.0**-10 if dtype == torch.float16 else 2.0**-7  # relative spacing of the 16-bit type
    close = (out.double() - ref).abs() <= 2 * ulp * ref.abs().clamp_min(1.0)  # a flip may carry to the next layer
    assert bool(close.all()), int((~close).sum())
    assert torch.equal(alive.bool(), out.double().ne(0).any(dim=1))
    with pytest.raises(RuntimeError, match="float32 CUDA tensor"):
        torch.ops.prunekit_spdnn.tiled(features.to(dtype), idx, val, bias, 32.0)


def test_relabelled_network_gives_the_same_categories():
    features = small_inputs(200)
    net = list(iter_layers(N, 12))
    other = list(relabel(net, seed=3))
    assert not torch.equal(other[1].cols, net[1].cols)
    assert torch.equal(infer(features, other, bias_for(N)), infer(features, net, bias_for(N)))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("neurons", [256, 1024, 4096])
def test_fused_chain_matches_float64_reference_on_cuda(neurons):
    from prunekit.kernels import spdnn_cuda

    count = 1500
    features, net, idx, val = _cuda_case(neurons, count, 24)
    # one chain of 3 layers, every output checked (poisoned input buffers are not reused: outputs are fresh)
    out, alive = torch.ops.prunekit_spdnn.chain(features.float(), idx[:3], val[:3], bias_for(neurons), 32.0)
    ref = features.clone()
    for layer in net[:3]:
        z = ref @ layer.dense()
        ref = torch.where(z != 0, z + bias_for(neurons), z).clamp(0, 32)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(alive.bool(), ref.any(dim=1))
    truth = infer(features, net, bias_for(neurons))
    fused = spdnn_cuda.infer_fused(features.float(), idx, val, bias_for(neurons), 32.0)
    assert truth.numel() > 0 and torch.equal(fused, truth)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("neurons", [1024, 4096])
def test_fused_chain_gives_the_same_bits_whatever_inputs_per_block_it_picks(neurons):
    """A chain launch takes fewer inputs per block when few are alive (down to 1): each input's output must be
    bit-for-bit the one it gets in a large batch (16 or 4 per block), and match float64."""

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    count = 16 * sms + 37  # the large batch keeps the widest blocks
    features, net, idx, val = _cuda_case(neurons, count, 6)
    features = features.float()
    bias = bias_for(neurons)
    big, big_alive = torch.ops.prunekit_spdnn.chain(features, idx, val, bias, 32.0)
    for small in (1, 3, 100, sms - 1, 2 * sms + 5, 8 * sms - 3):  # 1 to 16 inputs per block (at N = 1024)
        rows = torch.randperm(count, device="cuda")[:small]
        out, alive = torch.ops.prunekit_spdnn.chain(features[rows].contiguous(), idx, val, bias, 32.0)
        assert torch.equal(out, big[rows]) and torch.equal(alive, big_alive[rows]), small
    ref = features.double()
    for layer in net:
        z = ref @ layer.dense()
        ref = torch.where(z != 0, z + bias, z).clamp(0, 32)
    torch.testing.assert_close(big.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("neurons", [256, 1024, 4096])  # N = 4096: 8 inputs per block in one-layer launches, else 4
@pytest.mark.parametrize("layers", [1, 2, 4])
def test_chain_writes_every_output_whatever_its_length_and_when_blocks_die_early(neurons, layers):
    """The last layer of a chain stores straight to the output (a one-layer chain keeps one shared buffer and runs
    two blocks per SM); a block whose inputs all die stops early and must still write zeros. The output buffer is
    poisoned through the caching allocator (a NaN tensor of the same size freed just before), so an unwritten element
    shows; odd batch (a partial last block), and zero inputs that kill whole blocks at the first layer."""
    count = 16 * 80 + 5  # >= 66 blocks of 16 on the H100: the widest blocks
    features, net, idx, val = _cuda_case(neurons, count, layers)
    features[32:80] = 0  # three whole blocks of 16 inputs dead from the start
    features[5] = 0  # and a dead input inside a live block
    bias = bias_for(neurons)
    ref = _dense_layers(features, net, bias)
    for _ in range(2):  # the second pass reuses the first one's freed output
        poison = torch.full((count, neurons), float("nan"), device="cuda")
        del poison
        out, alive = torch.ops.prunekit_spdnn.chain(features.float(), idx, val, bias, 32.0)
        assert not bool(out.isnan().any())
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
        # alive is the kernel's own verdict on its float32 rows (float64 may leave a rounding residue where float32
        # reaches an exact 0 after the bias, and the reverse): it must match them, and float64 wherever that is clear
        assert torch.equal(alive.bool(), out.ne(0).any(dim=1))
        clear = ref.amax(dim=1).gt(1e-4) | ref.eq(0).all(dim=1)
        assert torch.equal(alive.bool()[clear], ref.ne(0).any(dim=1)[clear])
        assert not bool(alive[32:80].any()) and not bool(alive[5])


def test_pack_ell_stores_row_and_float16_weight_in_one_word_only_when_lossless(monkeypatch):
    from prunekit.kernels import spdnn_cuda
    from prunekit.kernels.spdnn_cuda import pack_ell

    gen = torch.Generator().manual_seed(3)
    idx = torch.randint(0, 4096, (3, 32, 4096), generator=gen, dtype=torch.int32)
    val = torch.randn(3, 32, 4096, generator=gen).to(torch.float16).float()
    val[0, 0, :7] = torch.tensor([0.0, -0.0, 65504.0, -(2.0**-24), 1 / 16, -3.5, 2.0**-14])
    idx[0, 0, :3] = torch.tensor([0, 4095, 65535 % 4096])
    words = pack_ell(idx, val)
    assert words is not None and words.dtype == torch.int32 and words.shape == idx.shape
    assert torch.equal(words & 0xFFFF, idx)
    weights = ((words.to(torch.int64) >> 16) & 0xFFFF).to(torch.int16).view(torch.float16).float()
    assert torch.equal(weights, val) and torch.equal(weights.signbit(), val.signbit())
    assert int(pack_ell(torch.zeros(1, 1, 8, dtype=torch.int32), torch.zeros(1, 1, 8)).abs().sum()) == 0
    assert pack_ell(idx, val + 1e-4) is None  # a weight that is not a float16
    nan = val.clone()
    nan[1, 2, 3] = float("nan")
    assert pack_ell(idx, nan) is None
    assert pack_ell(torch.zeros(1, 1, 65537, dtype=torch.int32), torch.zeros(1, 1, 65537)) is None
    monkeypatch.setattr(spdnn_cuda, "PACK_CHUNK_ENTRIES", 1)  # one layer per step: the same words
    assert torch.equal(pack_ell(idx, val), words)
    assert pack_ell(idx, nan) is None  # a bad weight in a later chunk
    in_place = idx.clone()
    assert pack_ell(in_place, nan, out=in_place) is None and torch.equal(in_place, idx)  # nothing written
    assert pack_ell(in_place, val, out=in_place).data_ptr() == in_place.data_ptr()
    assert torch.equal(in_place, words)  # the layers packed over their own indices


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("neurons", [256, 1024])
def test_chain_with_permuted_shared_rows_gives_the_same_bits(neurons):
    """row_pos moves each layer's input neurons to other shared-memory rows (the ELL then names those rows): the
    same products are summed in the same slot order, so every chain length gives the same bits, and the driver the
    same categories."""
    from prunekit.kernels import spdnn_cuda

    count = 16 * 80 + 3
    features, net, idx, val = _cuda_case(neurons, count, 6)
    features = features.float()
    bias = bias_for(neurons)
    gen = torch.Generator(device="cuda").manual_seed(7)
    pos = torch.stack([torch.randperm(neurons, device="cuda", generator=gen) for _ in net]).int()
    moved = torch.gather(pos[:, None, :].expand(-1, idx.shape[1], -1), 2, idx.long()).int()  # pos[l][idx[l]]
    for layers in (1, 2, 6):
        plain, plain_alive = torch.ops.prunekit_spdnn.chain(features, idx[:layers], val[:layers], bias, 32.0)
        out, alive = torch.ops.prunekit_spdnn.chain(features, moved[:layers], val[:layers], bias, 32.0, pos[:layers])
        assert torch.equal(out, plain) and torch.equal(alive, plain_alive), layers
    for layers in (1, 2, 6):  # the packed words (row | float16 weight) give the same bits as the pairs
        plain, plain_alive = torch.ops.prunekit_spdnn.chain(
            features, moved[:layers], val[:layers], bias, 32.0, pos[:layers]
        )
        words = spdnn_cuda.pack_ell(moved[:layers], val[:layers])
        out, alive = torch.ops.prunekit_spdnn.chain_packed(features, words, bias, 32.0, pos[:layers])
        assert torch.equal(out, plain) and torch.equal(alive, plain_alive), layers
    truth = spdnn_cuda.infer_fused(features, idx, val, bias, 32.0)
    assert torch.equal(spdnn_cuda.infer_fused(features, moved, val, bias, 32.0, pos), truth)
    packed = spdnn_cuda.pack_ell(moved, val)
    assert torch.equal(spdnn_cuda.infer_fused(features, moved, val, bias, 32.0, pos, packed), truth)
    with pytest.raises(RuntimeError, match="row_pos must be"):
        torch.ops.prunekit_spdnn.chain(features, moved, val, bias, 32.0, pos[:2])


def test_synthetic_rows_equal_coordinates_for_any_chunking():
    source = synthetic_image_set(N, 70, total_nnz=int(0.2 * N * 70))
    images, pixels = source.coordinates()
    dense = torch.zeros(70, N)
    dense[images, pixels] = 1
    assert torch.equal(source.rows(0, 70), dense)
    assert torch.equal(source.rows(13, 29, chunk_elements=3 * N), dense[13:29])
    assert torch.equal(dense.sum(dim=1).long(), source.lit)
    assert int(images.numel()) == int(0.2 * N * 70)


def test_truth_categories_equal_infer_at_every_checkpoint_with_small_batches():
    features = small_inputs(90)
    net = list(iter_layers(N, 12))
    truth = truth_categories(features.clone(), iter(net), bias_for(N), [3, 12], batch_inputs=7)
    assert torch.equal(truth[3], infer(features, net[:3], bias_for(N)))
    assert torch.equal(truth[12], infer(features, net, bias_for(N)))
    assert 0 < truth[12].numel() < truth[3].numel() <= 90


def test_compact_rows_moves_kept_rows_to_the_front_in_place():
    y = torch.arange(40.0).reshape(20, 2)
    keep = torch.tensor([1, 2, 7, 8, 9, 15, 19])
    expected = y[keep].clone()
    out = compact_rows_(y, keep, chunk_rows=2)
    assert out.data_ptr() == y.data_ptr() and torch.equal(out, expected)


def _cuda_case(neurons: int, count: int, layers: int):
    """Synthetic binary features (count, N) float64 on the GPU (25% density), the first ``layers`` challenge layers
    and their ELL form; loads the kernels."""
    from prunekit.kernels import spdnn_cuda

    spdnn_cuda.load()
    images, pixels = synthetic_images(neurons, count, total_nnz=int(0.25 * neurons * count))
    features = dense_features(images, pixels, count, neurons).cuda()
    net = list(iter_layers(neurons, layers, "cuda"))
    return (features, net, *_ell(net))


def _ell(net):
    from prunekit.kernels.spdnn_cuda import to_ell

    ells = [to_ell(*layer.csr_by_output(), torch.full((layer.nnz,), 1 / 16, device=layer.rows.device)) for layer in net]
    return torch.stack([e[0] for e in ells]), torch.stack([e[1] for e in ells])


def _dense_layers(features, net, bias):
    ref = features.clone()
    for layer in net:
        z = ref @ layer.dense().to(ref.device)
        ref = torch.where(z != 0, z + bias, z).clamp(0, 32)
    return ref


@pytest.mark.parametrize("count", [37, 48])  # a partial last tile, and whole tiles only
def test_tiled_kernel_emulation_matches_float64_reference(count):
    from prunekit.kernels.spdnn_cuda import emulate_tiled, infer_chained

    features = small_inputs(count)
    net = list(relabel(iter_layers(N, 10), seed=5))  # general layers: no generator structure to lean on
    idx, val = _ell(net)
    out, alive = emulate_tiled(features.float(), idx[:4], val[:4], bias_for(N), 32.0)
    ref = _dense_layers(features, net[:4], bias_for(N))
    assert not torch.isnan(out).any()  # skipped tiles' stale buffers never leak
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(alive.bool(), ref.any(dim=1))
    truth = infer(features, net, bias_for(N))
    assert torch.equal(infer_chained(emulate_tiled, features, idx, val, bias_for(N), 32.0), truth)


@pytest.mark.parametrize("seed", [None, 3])  # the challenge network, and a relabelled copy
def test_tiled_output_order_puts_equal_input_sets_side_by_side(seed):
    """In the challenge layers the 16 outputs b * N/16 + j share their 32 inputs: after the reordering every group of
    16 adjacent ELL columns names one input set, slot by slot; out_pos is a permutation naming each column's output."""
    from prunekit.kernels.spdnn_cuda import tiled_output_order_

    net = list(iter_layers(N, 6))
    net = list(relabel(net, seed)) if seed is not None else net
    idx, val = _ell(net)
    before = [{(int(o), frozenset(idx[k, :, o].tolist())) for o in range(N)} for k in range(len(net))]
    new_idx, new_val = idx.clone(), val.clone()
    out_pos = tiled_output_order_(new_idx, new_val)
    assert out_pos.dtype == torch.int32 and out_pos.shape == (len(net), N)
    for k in range(len(net)):
        assert torch.equal(out_pos[k].sort().values, torch.arange(N, dtype=torch.int32))
        after = {(int(out_pos[k, j]), frozenset(new_idx[k, :, j].tolist())) for j in range(N)}
        assert after == before[k]  # every output keeps its own inputs
        groups = new_idx[k].view(SPDNN_NNZ_PER_ROW, N // 16, 16)
        assert torch.equal(groups, groups[:, :, :1].expand_as(groups))  # 16 equal columns, slot by slot
        assert bool((new_idx[k, 1:] >= new_idx[k, :-1]).all())  # slots sorted by input
    assert torch.equal(new_val, torch.full_like(new_val, 1 / 16))


def test_tiled_output_order_keeps_padding_slots_last():
    from prunekit.kernels.spdnn_cuda import tiled_output_order_

    # 1 layer, 3 slots, 3 neurons; value 0 marks a padding slot (its index 0 is a placeholder)
    idx = torch.tensor([[[2, 0, 2], [0, 0, 1], [1, 0, 0]]], dtype=torch.int32)
    val = torch.tensor([[[1.0, 5.0, 2.0], [0.0, 0.0, 3.0], [4.0, 0.0, 0.0]]])
    out_pos = tiled_output_order_(idx, val)
    expect = {0: [(1, 4.0), (2, 1.0), (0, 0.0)], 1: [(0, 5.0), (0, 0.0), (0, 0.0)], 2: [(1, 3.0), (2, 2.0), (0, 0.0)]}
    for j in range(3):
        pairs = [(int(i), float(v)) for i, v in zip(idx[0, :, j], val[0, :, j], strict=True)]
        assert pairs == expect[int(out_pos[0, j])]


@pytest.mark.parametrize("count", [37, 48])
def test_tiled_kernel_emulation_with_output_order_matches_float64_reference(count):
    from prunekit.kernels.spdnn_cuda import emulate_tiled, infer_chained, tiled_output_order_

    features = small_inputs(count)
    net = list(relabel(iter_layers(N, 10), seed=5))
    idx, val = _ell(net)
    out_pos = tiled_output_order_(idx, val)
    out, alive = emulate_tiled(features.float(), idx[:4], val[:4], bias_for(N), 32.0, out_pos[:4])
    ref = _dense_layers(features, net[:4], bias_for(N))
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(alive.bool(), ref.any(dim=1))
    truth = infer(features, net, bias_for(N))
    live = infer_chained(emulate_tiled, features, idx, val, bias_for(N), 32.0, out_pos=out_pos)
    assert torch.equal(live, truth)


@pytest.mark.parametrize("settle", ["1", "0"])
def test_chain_driver_runs_the_settled_tail_in_one_launch(settle, monkeypatch):
    """After a chain of >= SETTLE_MIN_CHAIN layers that loses no input, the rest runs in one launch; the categories
    do not depend on it (emulated tiled op on the CPU, float64 truth)."""
    from prunekit.kernels import spdnn_cuda

    monkeypatch.setenv(spdnn_cuda.SETTLE_ENV, settle)
    features = small_inputs(60)
    net = list(iter_layers(N, 100))
    idx, val = _ell(net)
    launches = []

    def op(y, i, v, bias, cap):
        launches.append((y.shape[0], i.shape[0]))
        return spdnn_cuda.emulate_tiled(y, i, v, bias, cap)

    found = spdnn_cuda.infer_chained(op, features, idx, val, bias_for(N), 32.0)
    assert torch.equal(found, infer(features, net, bias_for(N)))
    assert sum(n for _, n in launches) == 100
    lengths = [n for _, n in launches]
    assert lengths[:4] == [2, 2, 4, 8]
    if settle == "1":
        # the first chain of >= 8 layers that keeps every input ends the chaining: one launch for the rest
        first = next(k for k in range(1, len(launches)) if launches[k - 1][1] >= spdnn_cuda.SETTLE_MIN_CHAIN
                     and launches[k][0] == launches[k - 1][0])  # fmt: skip
        assert first == len(launches) - 1 and lengths[-1] > spdnn_cuda.MAX_CHAIN
    else:
        assert max(lengths) <= spdnn_cuda.MAX_CHAIN


@pytest.mark.parametrize("first", ["1", "2"])
def test_chain_driver_gathering_live_rows_equals_copying_them(first, monkeypatch):
    """With ``gathers`` the driver hands the op the live rows of its last output instead of a compacted copy: the op
    (here the emulated tiled op behind a gather) sees the same inputs, and the categories and the trace agree."""
    from prunekit.kernels import spdnn_cuda

    monkeypatch.setenv(spdnn_cuda.FIRST_CHAIN_ENV, first)
    features = small_inputs(70)
    net = list(iter_layers(N, 40))
    idx, val = _ell(net)
    seen = {}

    def gathering(y, i, v, bias, cap, row_pos, rows):
        assert row_pos is None
        picked = y if rows is None else y[rows]
        seen.setdefault("gather", []).append(picked.clone())
        return spdnn_cuda.emulate_tiled(picked, i, v, bias, cap)

    def copying(y, i, v, bias, cap):
        seen.setdefault("copy", []).append(y.clone())
        return spdnn_cuda.emulate_tiled(y, i, v, bias, cap)

    traces = {"gather": [], "copy": []}
    got = spdnn_cuda.infer_chained(
        gathering, features, idx, val, bias_for(N), 32.0, gathers=True, trace=traces["gather"]
    )
    want = spdnn_cuda.infer_chained(copying, features, idx, val, bias_for(N), 32.0, trace=traces["copy"])
    assert torch.equal(got, want) and torch.equal(want, infer(features, net, bias_for(N)))
    assert len(seen["gather"]) == len(seen["copy"]) > 2
    for a, b in zip(seen["gather"], seen["copy"], strict=True):
        assert torch.equal(a, b)
    assert traces["gather"] == traces["copy"]
    assert [t["last"] - t["first"] + 1 for t in traces["copy"]][:2] == [int(first)] * 2
    assert any(t["live_out"] < t["live_in"] for t in traces["copy"])  # some launch dropped inputs


def test_chain_driver_launches_single_layers_while_the_rule_asks_then_doubles():
    """``one_layer`` (N = 4096's rule: more inputs per block in a one-layer launch) makes the driver launch layers
    alone while enough inputs live; then the usual 2, 2, 4, ... schedule starts; the categories do not change."""
    from prunekit.kernels import spdnn_cuda

    features = small_inputs(90)
    net = list(iter_layers(N, 40))
    idx, val = _ell(net)
    trace = []
    found = spdnn_cuda.infer_chained(
        spdnn_cuda.emulate_tiled, features, idx, val, bias_for(N), 32.0, trace=trace, one_layer=lambda live: live >= 60
    )
    assert torch.equal(found, infer(features, net, bias_for(N)))
    lengths = [t["last"] - t["first"] + 1 for t in trace]
    singles = [t["live_in"] >= 60 for t in trace]
    assert singles[0] and not singles[-1]
    assert all(n == 1 for n, one in zip(lengths, singles, strict=True) if one)
    rest = [n for n, one in zip(lengths, singles, strict=True) if not one]
    assert rest[:2] == [2, 2] and (len(rest) < 3 or rest[2] == 4)


def test_memory_budget_fits_every_network_on_an_80gb_h100_and_docs_quote_it():
    from prunekit.spdnn.generator import SPDNN_LAYERS, SPDNN_NEURONS
    from prunekit.spdnn.memory import H100_NBYTES, budget_table, default_kernel, memory_budget

    for neurons in SPDNN_NEURONS:
        for layers in SPDNN_LAYERS:
            b = memory_budget(neurons, layers, kernel=default_kernel(neurons))
            assert b.fits and b.peak_nbytes <= H100_NBYTES, (neurons, layers)
            assert b.batch_inputs % 16 == 0 or b.batch_inputs == 60000
            order = layers * neurons * 4 if b.kernel == "tiled" else 0  # the tiled kernel's output order
            assert b.ell_nbytes == layers * neurons * 32 * 8 + order
    assert memory_budget(65536, 1920).batch_inputs < 60000  # the largest network runs in input batches
    assert memory_budget(65536, 1920, device_nbytes=40 * 10**9).batch_inputs == 0  # does not fit 40 GB
    docs = (Path(__file__).resolve().parents[2] / "docs" / "SPDNN.md").read_text()
    assert budget_table() in docs


def test_partition_covers_every_input_once():
    for count, world in [(60000, 2), (301, 4), (5, 8)]:
        parts = [partition(count, r, world) for r in range(world)]
        assert parts[0][0] == 0 and parts[-1][1] == count
        assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))


def test_two_gloo_processes_give_the_single_process_categories(tmp_path):
    import subprocess
    import sys

    single = run_network(1024, 4, synthetic=True, inputs=256)
    assert single.passed and single.categories.numel() > 0
    out = tmp_path / "categories.tsv"
    cmd = [sys.executable, "-m", "prunekit.spdnn", "run", "-n", "1024", "-l", "4", "--synthetic", "--inputs", "256"]
    cmd += ["--device", "cpu", "--gpus", "2", "--categories-out", str(out), "--json", str(tmp_path / "r.json")]
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT")}
    # the child runs in tmp_path: a relative PYTHONPATH (the GPU scripts' PYTHONPATH=src) must not lose prunekit
    import prunekit

    src = str(Path(prunekit.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [env.get("PYTHONPATH")])])
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env | {"OMP_NUM_THREADS": "1"}
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert torch.equal(tsv.read_categories(out), single.categories), proc.stdout + proc.stderr
    import json

    row = json.loads((tmp_path / "r.json").read_text())[0]
    assert row["ranks"] == 2 and row["passed"] is True and row["inputs"] == 256


def test_champion_files_transpose_the_tsv_and_its_output_parses(tmp_path):
    from prunekit.spdnn.champion import champion_env, parse_champion_output, write_champion_files

    generate(tmp_path, N, [3], inputs=20)
    wpath, ipath = write_champion_files(tmp_path, N, 3)
    raw = np.fromfile(wpath, dtype=np.int32)
    nnz = N * 32
    assert raw.size == 3 * 3 * nnz
    layer2 = list(iter_layers(N, 2))[-1]
    rows, cols = torch.from_numpy(raw[3 * nnz : 4 * nnz] - 1), torch.from_numpy(raw[4 * nnz : 5 * nnz] - 1)
    assert torch.equal(rows, layer2.cols) and torch.equal(cols, layer2.rows)  # row = output neuron
    assert np.all(raw[5 * nnz : 6 * nnz].view(np.float32) == 0.0625)
    images, pixels = tsv.read_images(tmp_path, N)
    img = np.fromfile(ipath, dtype=np.int32)
    assert np.array_equal(img[: images.numel()] - 1, pixels.numpy())  # row = pixel, column = image
    env = champion_env(tmp_path, N, 3, images.numel(), 20)
    assert env["INPUT"] == str(images.numel()) and env["BIAS"] == "-0.3"
    text = "all categories: 515\nCHALLENGE PASSED!\nINFERENCE TIME: 0.012500 s\nINFERENCE THRP: 1.9e+13 EDGES/s (38 TFLOPS)"
    result = parse_champion_output(text)
    assert result.passed and result.categories == 515 and result.inference_s == 0.0125
    assert abs(result.teraedges_per_s - 19.0) < 1e-9
    with pytest.raises(PrunekitError):
        parse_champion_output("ERROR: need more GPU memory")


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("neurons", [256, 1024, 4096])
def test_tiled_kernel_matches_float64_reference_on_cuda(neurons):
    from prunekit.kernels import spdnn_cuda

    spdnn_cuda.load()
    count = 1000  # not a multiple of 16: a partial last tile
    features = synthetic_image_set(neurons, count, total_nnz=int(0.25 * neurons * count)).rows(0, count, "cuda")
    net = list(relabel(iter_layers(neurons, 24, "cuda"), seed=2))
    idx, val = _ell(net)
    out, alive = torch.ops.prunekit_spdnn.tiled(features, idx[:3], val[:3], bias_for(neurons), 32.0)
    ref = _dense_layers(features.double(), net[:3], bias_for(neurons))
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(alive.bool(), ref.any(dim=1))
    emulated, _ = spdnn_cuda.emulate_tiled(features[:40], idx[:3], val[:3], bias_for(neurons), 32.0)
    torch.testing.assert_close(out[:40], emulated, rtol=1e-5, atol=1e-5)
    truth = infer(features.double(), net, bias_for(neurons))
    assert truth.numel() > 0
    assert torch.equal(spdnn_cuda.infer_tiled(features, idx, val, bias_for(neurons), 32.0), truth)
    assert torch.equal(spdnn_cuda.infer_fused(features, idx, val, bias_for(neurons), 32.0), truth)
    out_pos = spdnn_cuda.tiled_output_order_(idx, val)  # the same layers, outputs with equal inputs side by side
    # poison the op's two ping-pong buffers through the caching allocator: an output row out_pos misses would show
    poison = [torch.full((-(-count // 16), neurons, 16), float("nan"), device="cuda") for _ in range(2)]
    del poison
    ordered = torch.ops.prunekit_spdnn.tiled(features, idx[:3], val[:3], bias_for(neurons), 32.0, out_pos[:3])
    torch.testing.assert_close(ordered[0].double(), ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(ordered[1].bool(), ref.any(dim=1))
    assert torch.equal(spdnn_cuda.infer_tiled(features, idx, val, bias_for(neurons), 32.0, out_pos), truth)
    with pytest.raises(RuntimeError, match="out_pos must be"):
        torch.ops.prunekit_spdnn.tiled(features, idx[:3], val[:3], bias_for(neurons), 32.0, out_pos[:2])
    words = spdnn_cuda.pack_ell(idx, val)  # relabelled challenge weights are 1/16: lossless
    assert words is not None
    packed = torch.ops.prunekit_spdnn.tiled_packed(features, words[:3], bias_for(neurons), 32.0, out_pos[:3])
    assert torch.equal(packed[0], ordered[0]) and torch.equal(packed[1], ordered[1])  # the same sums, bit for bit
    assert torch.equal(
        spdnn_cuda.infer_tiled(features, idx, val, bias_for(neurons), 32.0, out_pos, packed=words), truth
    )


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("groups", [2, 3, 7, 200])  # 200: more groups than tiles (one tile each)
def test_tiled_tile_groups_on_streams_give_the_same_bits(monkeypatch, groups):
    """$PRUNEKIT_SPDNN_TILED_STREAMS: tile groups on their own streams compute every tile as one launch does (the
    same sums, bit for bit), with the output poisoned first, ordered and packed layers alike."""
    from prunekit.kernels import spdnn_cuda

    spdnn_cuda.load()
    neurons, count, layers = 1024, 1000, 12  # 63 tiles, the last one partial
    features = synthetic_image_set(neurons, count, total_nnz=int(0.25 * neurons * count)).rows(0, count, "cuda")
    net = list(relabel(iter_layers(neurons, layers, "cuda"), seed=4))
    idx, val = _ell(net)
    out_pos = spdnn_cuda.tiled_output_order_(idx, val)
    words = spdnn_cuda.pack_ell(idx, val)
    monkeypatch.setenv("PRUNEKIT_SPDNN_TILED_STREAMS", "1")
    one = torch.ops.prunekit_spdnn.tiled(features, idx, val, bias_for(neurons), 32.0, out_pos)
    one_packed = torch.ops.prunekit_spdnn.tiled_packed(features, words, bias_for(neurons), 32.0, out_pos)
    truth = infer(features.double(), net, bias_for(neurons))
    monkeypatch.setenv("PRUNEKIT_SPDNN_TILED_STREAMS", str(groups))
    poison = [torch.full((-(-count // 16), neurons, 16), float("nan"), device="cuda") for _ in range(2)]
    del poison
    many = torch.ops.prunekit_spdnn.tiled(features, idx, val, bias_for(neurons), 32.0, out_pos)
    many_packed = torch.ops.prunekit_spdnn.tiled_packed(features, words, bias_for(neurons), 32.0, out_pos)
    assert torch.equal(many[0], one[0]) and torch.equal(many[1], one[1])
    assert torch.equal(many_packed[0], one_packed[0]) and torch.equal(many_packed[1], one_packed[1])
    assert not torch.isnan(many[0]).any() and truth.numel() > 0
    assert torch.equal(many[1].nonzero().squeeze(1).cpu(), truth)
    assert torch.equal(spdnn_cuda.infer_tiled(features, idx, val, bias_for(neurons), 32.0, out_pos), truth)


@pytest.mark.cuda
@CUDA
def test_synthetic_images_are_the_same_on_cpu_and_cuda():
    source = synthetic_image_set(4096, 300)
    assert torch.equal(source.rows(0, 300, "cuda").cpu(), source.rows(0, 300))


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize(("neurons", "kernel"), [(1024, "tiled"), (1024, "fused"), (65536, "tiled")])
def test_synthetic_run_passes_on_cuda_in_input_batches(neurons, kernel):
    r = run_network(neurons, 4, synthetic=True, device="cuda", inputs=300, kernel=kernel, batch_inputs=48)
    assert r.kernel == kernel and r.passed is True and r.categories.numel() > 0


@pytest.mark.cuda
@CUDA
def test_synthetic_run_equals_the_file_run_on_cuda(tmp_path):
    generate(tmp_path, 1024, [4], inputs=300, device="cuda")
    from_files = run_network(1024, 4, data=tmp_path, device="cuda")
    synthetic = run_network(1024, 4, synthetic=True, device="cuda", inputs=300)
    assert from_files.passed and synthetic.passed and synthetic.categories.numel() > 0
    assert torch.equal(from_files.categories, synthetic.categories)


def test_float64_truth_resolves_exact_ties_independent_of_summation_order():
    # N=1024, 4 layers, 300 synthetic inputs: many pre-activations are exactly 0 in exact arithmetic; a plain
    # float64 dense matmul keeps +1e-16 residues alive (47 survivors), the exact answer is 38
    neurons, layers, count = 1024, 4, 300
    features = synthetic_image_set(neurons, count).rows(0, count, "cpu", torch.float64)
    truth = truth_categories(features.clone(), iter_layers(neurons, layers, "cpu"), bias_for(neurons), [layers])
    y = features.clone()
    for layer in iter_layers(neurons, layers, "cpu"):
        offsets, inputs = layer.csr_by_output()
        rows = torch.repeat_interleave(torch.arange(neurons), offsets[1:] - offsets[:-1])
        w_t = torch.zeros(neurons, neurons, dtype=torch.float64)
        w_t[rows, inputs.long()] = 0.0625
        z = y.flip(1) @ w_t.t().flip(0)  # another summation order
        z = torch.where(z != 0, z + bias_for(neurons), z)
        y = torch.where(z.abs() <= 1e-10, torch.zeros_like(z), z).clamp(0.0, 32.0)
    exact = torch.nonzero((y != 0).any(dim=1)).flatten()
    assert torch.equal(truth[layers], exact) and exact.numel() == 38
    assert torch.equal(infer(features.clone(), iter_layers(neurons, layers, "cpu"), bias_for(neurons)), exact)
    y32 = features.float()
    assert torch.equal(infer(y32, iter_layers(neurons, layers, "cpu"), bias_for(neurons)), exact)


# --- arbitration of a disputed truth (run.arbitrate_categories) ------------------------------------------------------


def _truth_run():
    right = run_network(1024, 4, synthetic=True, inputs=200)
    assert right.passed and right.disputed == 0 and not right.arbitrated
    assert right.truth_count == right.categories.numel() > 1
    return right


def test_a_wrong_first_truth_is_corrected_by_the_cpu_reference_on_the_disputed_inputs():
    right = _truth_run()
    cats = right.categories
    not_a_category = next(i for i in range(200) if i not in set(cats.tolist()))
    # a first truth that misses one true category and claims one input that dies (as a GPU truth might)
    wrong = torch.sort(torch.cat([cats[1:], torch.tensor([not_a_category])])).values
    r = run_network(1024, 4, synthetic=True, inputs=200, truth=wrong)
    assert r.passed is True and r.disputed == 2 and r.arbitrated
    assert r.truth_count == cats.numel()
    off = run_network(1024, 4, synthetic=True, inputs=200, truth=wrong, arbitrate=False)
    assert off.passed is False and off.disputed == 2 and not off.arbitrated


def test_arbitration_does_not_excuse_a_wrong_kernel(monkeypatch):
    from prunekit.spdnn import run as run_module

    right = _truth_run()
    real = run_module._infer_reference

    def drops_the_first_survivor(*args, **kwargs):
        return real(*args, **kwargs)[1:]

    monkeypatch.setattr(run_module, "_infer_reference", drops_the_first_survivor)
    r = run_network(1024, 4, synthetic=True, inputs=200, truth=right.categories)
    assert r.passed is False and r.disputed == 1 and r.arbitrated
    assert r.truth_count == right.categories.numel()


def test_a_truth_from_files_is_never_arbitrated(tmp_path):
    generate(tmp_path, 1024, [4], inputs=120)
    truth = tsv.read_categories(tsv.categories_path(tmp_path, 1024, 4))
    assert truth.numel() > 1
    tsv.write_categories(tsv.categories_path(tmp_path, 1024, 4), truth[1:], overwrite=True)
    r = run_network(1024, 4, data=tmp_path)
    assert r.passed is False and r.disputed == 1 and not r.arbitrated


def test_generate_recheck_drops_a_false_category_and_keeps_the_true_ones():
    """A GPU float64 truth is re-checked on the CPU (run._recheck_positives_on_cpu): a category the CPU reference
    does not confirm is dropped at every L, the confirmed ones stay."""
    from prunekit.spdnn.run import _recheck_positives_on_cpu

    source = synthetic_image_set(N, 400)
    features = source.rows(0, 400, "cpu", torch.float64)
    truth = truth_categories(features, iter_layers(N, 3), bias_for(N), [2, 3], 400)
    dead = next(i for i in range(400) if i not in set(truth[2].tolist()) | set(truth[3].tolist()))
    forged = {count: torch.sort(torch.cat([t, torch.tensor([dead])])).values for count, t in truth.items()}
    fixed = _recheck_positives_on_cpu(source, N, forged)
    assert truth[3].numel() > 0
    for count in (2, 3):
        assert torch.equal(fixed[count], truth[count])
