"""prunekit: prune neural networks, store them in kernel-ready sparse formats, ship and run them."""

__version__ = "0.1.0"
