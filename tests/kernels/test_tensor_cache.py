import torch

from prunekit.kernels.tensor_cache import cached, peek


def test_peek_sees_what_cached_kept_and_nothing_once_the_input_changed():
    owner = torch.arange(6)
    assert peek(owner, "_test_entry", (owner,), 1) is None  # nothing kept yet
    built = []
    value = cached(owner, "_test_entry", (owner,), 1, lambda: built.append(1) or "value")
    assert value == "value" and built == [1]
    assert peek(owner, "_test_entry", (owner,), 1) == "value"
    assert peek(owner, "_test_entry", (owner,), 2) is None  # another extra key
    assert built == [1]  # peek never builds
    owner.add_(1)  # a new version: the kept value is stale
    assert peek(owner, "_test_entry", (owner,), 1) is None
