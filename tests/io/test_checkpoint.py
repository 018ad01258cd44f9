from __future__ import annotations

import pickle

import pytest
import torch
from safetensors.torch import load_file, save_file

from prunekit.errors import CheckpointError, OutputExistsError
from prunekit.io import atomic_path, open_checkpoint
from prunekit.io.safetensors_io import StreamingWriter

from ..conftest import mlp_state


def test_streaming_writer_output_is_read_back_by_the_safetensors_library(tmp_path):
    state = mlp_state(dtype=torch.bfloat16)
    state["empty"] = torch.empty(0, 3)
    state["flag"] = torch.tensor([True, False])
    path = tmp_path / "out.safetensors"
    with StreamingWriter(path, {"k": "v"}) as writer:
        for name, t in state.items():
            writer.write(name, t)
    loaded = load_file(str(path))
    assert loaded.keys() == state.keys()
    for name in state:
        assert torch.equal(loaded[name], state[name])
    assert not list(tmp_path.glob("*.spool"))


def test_safetensors_and_torch_checkpoints_give_the_same_tensors(mlp_safetensors, mlp_pt):
    a, b = open_checkpoint(mlp_safetensors), open_checkpoint(mlp_pt)
    assert sorted(a.names()) == sorted(b.names())
    for name in a.names():
        assert a.shape(name) == b.shape(name) and a.dtype(name) == b.dtype(name)
        assert torch.equal(a.get(name), b.get(name))


def test_truncated_safetensors_is_a_checkpoint_error(mlp_safetensors):
    data = mlp_safetensors.read_bytes()
    mlp_safetensors.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match="truncated"):
        open_checkpoint(mlp_safetensors)


@pytest.mark.parametrize(
    "payload", [b"", b"garbage!", b"\xff" * 64, (20).to_bytes(8, "little") + b"{not json}         "]
)
def test_corrupt_safetensors_is_a_checkpoint_error(tmp_path, payload):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(payload)
    with pytest.raises(CheckpointError):
        open_checkpoint(path)


class Evil:
    def __reduce__(self):
        return (print, ("pwned",))


def test_pickles_that_weights_only_refuses_are_checkpoint_errors(tmp_path):
    path = tmp_path / "evil.pt"
    with open(path, "wb") as f:
        pickle.dump({"w": Evil()}, f)
    with pytest.raises(CheckpointError):
        open_checkpoint(path)
    path2 = tmp_path / "evil2.pt"
    torch.save({"w": torch.ones(2), "obj": Evil()}, path2)
    with pytest.raises(CheckpointError, match="weights_only"):
        open_checkpoint(path2)


def test_non_state_dict_pickle_is_rejected(tmp_path):
    path = tmp_path / "list.pt"
    torch.save([torch.ones(2)], path)
    with pytest.raises(CheckpointError, match="state dict"):
        open_checkpoint(path)


def test_hf_dir_without_weights_and_unknown_kinds_are_rejected(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="model.safetensors"):
        open_checkpoint(tmp_path / "hf")
    (tmp_path / "w.npz").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="unknown checkpoint kind"):
        open_checkpoint(tmp_path / "w.npz")
    with pytest.raises(CheckpointError, match="not found"):
        open_checkpoint(tmp_path / "missing.safetensors")


def test_atomic_path_leaves_nothing_on_failure_and_refuses_existing_outputs(tmp_path):
    out = tmp_path / "out.safetensors"
    with pytest.raises(RuntimeError):
        with atomic_path(out) as tmp:
            save_file({"a": torch.ones(1)}, str(tmp))
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []
    with atomic_path(out) as tmp:
        tmp.write_text("first")
    with pytest.raises(OutputExistsError):
        with atomic_path(out):
            pass
    with atomic_path(out, overwrite=True) as tmp:
        tmp.write_text("second")
    assert out.read_text() == "second"
    assert [p.name for p in tmp_path.iterdir()] == ["out.safetensors"]
