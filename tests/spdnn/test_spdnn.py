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
    synthetic_images,
)
from prunekit.spdnn.ops import spdnn_layer
from prunekit.spdnn.reference import dense_features, infer
from prunekit.spdnn.run import generate, run_network

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


def test_relabelled_network_gives_the_same_categories():
    features = small_inputs(200)
    net = list(iter_layers(N, 12))
    other = relabel(net, seed=3)
    assert not torch.equal(other[1].cols, net[1].cols)
    assert torch.equal(infer(features, other, bias_for(N)), infer(features, net, bias_for(N)))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("neurons", [256, 1024, 4096])
def test_fused_chain_matches_float64_reference_on_cuda(neurons):
    from prunekit.kernels import spdnn_cuda

    spdnn_cuda.load()
    count = 1500
    images, pixels = synthetic_images(neurons, count, total_nnz=int(0.25 * neurons * count))
    features = dense_features(images, pixels, count, neurons).cuda()
    net = list(iter_layers(neurons, 24, "cuda"))
    ells = [spdnn_cuda.to_ell(*layer.csr_by_output(), torch.full((layer.nnz,), 1 / 16, device="cuda")) for layer in net]
    idx, val = torch.stack([e[0] for e in ells]), torch.stack([e[1] for e in ells])
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
