"""The challenge's TSV files (1-based ``row<TAB>col<TAB>value``), read and written.

Layout of a data directory (the official one and ours are interchangeable)::

    neuron{N}/n{N}-l{k}.tsv          layer k of the network with N neurons (value 0.0625)
    sparse-images-{N}.tsv            input features: image index, column-major pixel index, 1
    neuron{N}-l{L}-categories.tsv    1-based indices of inputs whose final row is non-zero
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..errors import PrunekitError
from ..io import atomic_path
from .generator import Layer


def layer_path(root: Path, neurons: int, index: int) -> Path:
    return Path(root) / f"neuron{neurons}" / f"n{neurons}-l{index}.tsv"


def images_path(root: Path, neurons: int) -> Path:
    return Path(root) / f"sparse-images-{neurons}.tsv"


def categories_path(root: Path, neurons: int, layers: int) -> Path:
    return Path(root) / f"neuron{neurons}-l{layers}-categories.tsv"


def _read_pairs(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    if not path.is_file():
        raise PrunekitError(f"missing challenge file {path}")
    try:
        data = np.loadtxt(path, dtype=np.int64, usecols=(0, 1), ndmin=2, comments="%")
    except ValueError as exc:
        raise PrunekitError(f"{path}: not a challenge TSV file ({exc})") from None
    return torch.from_numpy(data[:, 0] - 1), torch.from_numpy(data[:, 1] - 1)


def _write_pairs(path: Path, first: torch.Tensor, second: torch.Tensor, value: str, overwrite: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pairs = zip((first.cpu() + 1).tolist(), (second.cpu() + 1).tolist())
    text = "".join([f"{a}\t{b}\t{value}\n" for a, b in pairs])  # 2-3x faster than np.savetxt
    with atomic_path(path, overwrite) as tmp:
        Path(tmp).write_text(text)


def write_layer(root: Path, layer: Layer, overwrite: bool = False) -> Path:
    """Write a layer as ``neuron{N}/n{N}-l{k}.tsv``."""
    path = layer_path(root, layer.neurons, layer.index)
    _write_pairs(path, layer.rows, layer.cols, "0.0625", overwrite)
    return path


def read_layer(root: Path, neurons: int, index: int) -> Layer:
    """Read layer ``index`` (1-based) of the N-neuron network.

    Raises:
        PrunekitError: missing or malformed file, or indices outside the N x N matrix.
    """
    path = layer_path(root, neurons, index)
    rows, cols = _read_pairs(path)
    if rows.numel() and (
        int(rows.min()) < 0 or int(cols.min()) < 0 or int(rows.max()) >= neurons or int(cols.max()) >= neurons
    ):
        raise PrunekitError(f"{path}: indices outside a {neurons} x {neurons} layer")
    order = torch.argsort(rows * neurons + cols)
    return Layer(index, neurons, rows[order], cols[order])


def write_images(root: Path, neurons: int, images: torch.Tensor, pixels: torch.Tensor, overwrite: bool = False) -> Path:
    path = images_path(root, neurons)
    _write_pairs(path, images, pixels, "1", overwrite)
    return path


def read_images(root: Path, neurons: int) -> tuple[torch.Tensor, torch.Tensor]:
    """0-based (image, pixel) coordinates of ``sparse-images-{N}.tsv``.

    Raises:
        PrunekitError: missing/malformed file or pixels outside [1, N].
    """
    path = images_path(root, neurons)
    images, pixels = _read_pairs(path)
    if pixels.numel() and (int(pixels.min()) < 0 or int(pixels.max()) >= neurons):
        raise PrunekitError(f"{path}: pixel indices outside 1..{neurons}")
    return images, pixels


def write_categories(path: Path, categories: torch.Tensor, overwrite: bool = False) -> Path:
    """One 1-based input index per line."""
    with atomic_path(path, overwrite) as tmp:
        tmp.write_text("".join(f"{int(c) + 1}\n" for c in categories))
    return path


def read_categories(path: Path) -> torch.Tensor:
    """0-based sorted indices from a categories file."""
    text = path.read_text().split()
    try:
        return torch.tensor(sorted(int(t) - 1 for t in text), dtype=torch.int64)
    except ValueError:
        raise PrunekitError(f"{path}: not a categories file (one integer per line)") from None
