"""Files for, and output of, the 2020 champion's single-GPU code (Hidayetoglu et al., HPEC 2020;
github.com/merthidayetoglu/SpDNN_Challenge2020, ``singlegpu/``), run beside ours in the same benchmark.

Its ``main.cpp`` reads two binary files from ``$DATASET`` (and the official categories TSV):

- ``neuron{N}.bin``: for each layer in order, ``nnz`` int32 rows, ``nnz`` int32 columns, ``nnz`` float32 values,
  1-based, where the row is the *output* neuron (it builds CSR by row and gathers features by column), i.e.
  the transpose of the TSV's (input row, output column);
- ``sparse-images-{N}.bin``: ``nnz`` int32 rows = pixel, ``nnz`` int32 columns = image, ``nnz`` float32 values,
  1-based (the transpose of the TSV's (image, pixel));

and the environment: ``DATASET NEURON LAYER BATCH INPUT`` (= image nnz) ``BIAS BLOCKSIZE BUFFER``. It prints
``INFERENCE TIME: <s> s``, ``INFERENCE THRP: <edges/s> EDGES/s`` and ``CHALLENGE PASSED!`` on success.
Their code is never copied here: it is fetched, built and run by ``scripts/gpu_spdnn.sh``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import PrunekitError
from ..io import atomic_path
from . import tsv
from .generator import bias_for

CHAMPION_BLOCKSIZE = 256  # their run scripts' settings (singlegpu/run_ampere.sh)
CHAMPION_BUFFER_KB = 24


def weights_path(root: Path, neurons: int) -> Path:
    return Path(root) / f"neuron{neurons}.bin"


def images_bin_path(root: Path, neurons: int) -> Path:
    return Path(root) / f"sparse-images-{neurons}.bin"


def write_champion_files(data: str | Path, neurons: int, layers: int, out: str | Path | None = None) -> list[Path]:
    """Convert a data directory's TSV layers 1..``layers`` and images into the champion's binary files
    (each written to a temporary file and renamed when complete).

    Returns:
        The two paths written (``neuron{N}.bin``, ``sparse-images-{N}.bin``) in ``out`` (default ``data``).

    Raises:
        PrunekitError: a missing or malformed TSV file.
    """
    data = Path(data)
    out = Path(out) if out is not None else data
    out.mkdir(parents=True, exist_ok=True)
    wpath = weights_path(out, neurons)
    with atomic_path(wpath, overwrite=True) as tmp, open(tmp, "wb") as fh:
        for k in range(1, layers + 1):
            layer = tsv.read_layer(data, neurons, k)
            (layer.cols.numpy() + 1).astype(np.int32).tofile(fh)  # row = output neuron
            (layer.rows.numpy() + 1).astype(np.int32).tofile(fh)  # column = input neuron
            np.full(layer.nnz, 0.0625, dtype=np.float32).tofile(fh)
    images, pixels = tsv.read_images(data, neurons)
    ipath = images_bin_path(out, neurons)
    with atomic_path(ipath, overwrite=True) as tmp, open(tmp, "wb") as fh:
        (pixels.numpy() + 1).astype(np.int32).tofile(fh)
        (images.numpy() + 1).astype(np.int32).tofile(fh)
        np.ones(images.numel(), dtype=np.float32).tofile(fh)
    return [wpath, ipath]


def champion_env(data: str | Path, neurons: int, layers: int, image_nnz: int, inputs: int = 60000) -> dict[str, str]:
    """The environment variables their ``inference`` binary reads."""
    return {
        "DATASET": str(Path(data)),
        "NEURON": str(neurons),
        "LAYER": str(layers),
        "BATCH": str(inputs),
        "INPUT": str(image_nnz),
        "BIAS": str(bias_for(neurons)),
        "BLOCKSIZE": str(CHAMPION_BLOCKSIZE),
        "BUFFER": str(CHAMPION_BUFFER_KB),
    }


@dataclass(frozen=True)
class ChampionResult:
    inference_s: float
    edges_per_s: float
    passed: bool
    categories: int | None  # "all categories: K" (None when not printed)

    @property
    def teraedges_per_s(self) -> float:
        return self.edges_per_s / 1e12


def parse_champion_output(text: str) -> ChampionResult:
    """Parse the stdout of their ``inference`` binary.

    Raises:
        PrunekitError: no ``INFERENCE TIME`` / ``INFERENCE THRP`` line (the run failed).
    """
    time_m = re.search(r"INFERENCE TIME:\s*([0-9.eE+-]+)\s*s", text)
    thrp_m = re.search(r"INFERENCE THRP:\s*([0-9.eE+-]+)\s*EDGES/s", text)
    if not time_m or not thrp_m:
        raise PrunekitError("the champion's output has no INFERENCE TIME / INFERENCE THRP line (did it run?)")
    cat_m = re.search(r"all categories:\s*(\d+)", text)
    return ChampionResult(
        float(time_m.group(1)),
        float(thrp_m.group(1)),
        "CHALLENGE PASSED!" in text,
        int(cat_m.group(1)) if cat_m else None,
    )
