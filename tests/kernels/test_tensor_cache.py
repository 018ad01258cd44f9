import torch

from prunekit.kernels.tensor_cache import cached, cached_stamped, peek, stamp


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


def test_cached_stamped_is_cached_with_the_stamp_given():
    owner, other = torch.arange(6), torch.arange(3)
    built = []

    def build(tag):
        return lambda: built.append(tag) or tag

    assert cached_stamped(owner, "_test_stamped", stamp((owner, other)), (owner, other), None, build("a")) == "a"
    # cached() and cached_stamped() read and write the same entry
    assert cached(owner, "_test_stamped", (owner, other), None, build("b")) == "a" and built == ["a"]
    other.add_(1)  # after an edit the caller's new stamp no longer matches: built again
    assert peek(owner, "_test_stamped", (owner, other), None) is None
    assert cached_stamped(owner, "_test_stamped", stamp((owner, other)), (owner, other), None, build("c")) == "c"
    assert built == ["a", "c"] and peek(owner, "_test_stamped", (owner, other), None) == "c"
