"""The self-contained prunekit runtime: load a package and run it with sparse layers.

Needs only torch and safetensors (plus transformers for Hugging Face architectures). It is
copied, with ``formats/``, ``kernels/`` and ``errors.py``, into every package's ``runtime/``::

    import sys; sys.path.insert(0, "my-model.prunekit")
    import runtime
    pkg = runtime.load("my-model.prunekit")
    out = runtime.run(pkg, texts=["a sentence"])
"""

from .loader import LoadedPackage, SparseStateDict, load, pool, run, run_hf
from .manifest import MANIFEST, SCHEMA_VERSION, WEIGHTS, Manifest, TensorEntry, read_manifest, verify_files
from .sparse_linear import SparseLinear

__all__ = [
    "LoadedPackage",
    "SparseStateDict",
    "SparseLinear",
    "Manifest",
    "TensorEntry",
    "MANIFEST",
    "WEIGHTS",
    "SCHEMA_VERSION",
    "load",
    "run",
    "run_hf",
    "pool",
    "read_manifest",
    "verify_files",
]
