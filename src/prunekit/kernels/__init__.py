"""Sparse matmul kernels: torch.library custom ops with CUDA, CPU-reference and fake impls.

torch only, relative imports only: this package is copied into exported packages' ``runtime/``.
"""
