"""The fast-call module (``kernels/fastcall.py``, ``csrc/fastcall/fastcall.cpp``): each function calls its operator
with the arguments it was given, and ``entry`` falls back to the ``OpOverload``.

On the CPU the module is built for real, and the five operators are defined with the schemas the kernel sources
register (read from those sources), with CPU implementations that echo their arguments: a wrong order, a dropped
argument, or a signature that differs from the registration's shows up here without a GPU, and so does whether a
call skipped torch's autograd fallback (only where no argument requires a gradient, or under no_grad). The GPU tests
of the runtime's eager paths run the real operators through it."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from prunekit.kernels import build, fastcall


def registered_schemas() -> dict[str, str]:
    """``namespace::name`` -> the schema string its kernel source registers, for every operator in ENTRIES."""
    wanted = {f"{ns}::{op}" for ns, op in fastcall.ENTRIES.values()}
    found = {}
    for path in build.CSRC_DIR.rglob("*.c*"):
        text = path.read_text()
        lib = re.search(r"TORCH_LIBRARY(?:_FRAGMENT)?\((\w+), m\)", text)
        if not lib:
            continue
        for call in re.finditer(r"m\.def\(\s*((?:\"(?:[^\"\\]|\\.)*\"\s*)+)", text):
            schema = "".join(re.findall(r"\"((?:[^\"\\]|\\.)*)\"", call.group(1)))
            name = f"{lib.group(1)}::{schema.split('(', 1)[0]}"
            if name in wanted:
                found[name] = schema
    return found


def test_every_entry_has_a_registered_schema():
    schemas = registered_schemas()
    assert sorted(schemas) == sorted(f"{ns}::{op}" for ns, op in fastcall.ENTRIES.values())
    assert (
        schemas["prunekit_nm24::linear"]
        == "linear(Tensor(a!) plan, Tensor x, Tensor? bias, bool relu, int cfg) -> Tensor"
    )


def test_entry_is_the_op_overload_when_turned_off(monkeypatch):
    import torch

    # a namespace of this test's own: the kernels' namespaces must not gain operators in this process
    monkeypatch.setitem(fastcall.ENTRIES, "spmv24", ("prunekit_fastcall_test", "spmv24"))
    monkeypatch.setattr(fastcall, "_state", {})  # the variable is read when the module is first needed
    monkeypatch.setattr(fastcall, "_overloads", {})
    monkeypatch.setattr(fastcall, "_fast", {})
    monkeypatch.setenv(fastcall.ENV, "0")
    lib = torch.library.Library("prunekit_fastcall_test", "FRAGMENT")
    try:
        lib.define("spmv24(Tensor values, Tensor metadata, Tensor x, Tensor? bias, bool relu, bool rows) -> Tensor")
        assert fastcall.entry("spmv24") is torch.ops.prunekit_fastcall_test.spmv24.default
        # read once per process: unsetting it later builds nothing, and the OpOverload is kept
        monkeypatch.delenv(fastcall.ENV)
        monkeypatch.setattr(fastcall, "_build", lambda name: pytest.fail("the module was turned off"))
        assert fastcall.load() is None and fastcall.loaded_path() is None
        assert fastcall.entry("spmv24") is torch.ops.prunekit_fastcall_test.spmv24.default
    finally:
        lib._destroy()
    with pytest.raises(KeyError):
        fastcall.entry("nm_mm")


def test_disabled_gives_the_op_overload_inside_the_block(monkeypatch):
    import torch

    monkeypatch.setattr(fastcall, "load", lambda: pytest.fail("load must not run inside disabled()"))
    monkeypatch.setattr(fastcall, "_overloads", {})
    schema = registered_schemas()["prunekit_ext::spmm_csr_auto"]
    monkeypatch.setitem(fastcall.ENTRIES, "spmm_csr_auto", ("prunekit_fastcall_test", "spmm_csr_auto"))
    lib = torch.library.Library("prunekit_fastcall_test", "FRAGMENT")
    try:
        lib.define(schema)
        with fastcall.disabled():
            assert fastcall.entry("spmm_csr_auto") is torch.ops.prunekit_fastcall_test.spmm_csr_auto.default
    finally:
        lib._destroy()


def test_entry_waits_for_the_module_to_find_its_operator(monkeypatch):
    """The module's function is handed out only once its ``ready`` says the operator was found with the expected
    signature; until then (a library not loaded yet, a signature the build does not match) the OpOverload is."""
    import torch

    class Module:
        found = False

        def ready(self, name):
            return self.found

        def spmv24(self, *args):
            return "fast"

    module = Module()
    monkeypatch.setitem(fastcall.ENTRIES, "spmv24", ("prunekit_fastcall_test", "spmv24"))
    monkeypatch.setattr(fastcall, "_state", {"module": module, "path": None})
    monkeypatch.setattr(fastcall, "_overloads", {})
    monkeypatch.setattr(fastcall, "_fast", {})
    lib = torch.library.Library("prunekit_fastcall_test", "FRAGMENT")
    try:
        lib.define("spmv24(Tensor values, Tensor metadata, Tensor x, Tensor? bias, bool relu, bool rows) -> Tensor")
        assert fastcall.entry("spmv24") is torch.ops.prunekit_fastcall_test.spmv24.default
        module.found = True
        assert fastcall.entry("spmv24") == module.spmv24 and fastcall.entry("spmv24")() == "fast"
        module.found = False  # kept once found
        assert fastcall.entry("spmv24")() == "fast"
    finally:
        lib._destroy()


def test_a_failed_build_falls_back_once(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(fastcall, "_state", {})
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv(build.PREBUILT_ENV, str(tmp_path / "none"))
    monkeypatch.delenv(fastcall.ENV, raising=False)
    monkeypatch.setattr(fastcall, "_build", lambda name: (_ for _ in ()).throw(RuntimeError("Ninja is required\nmore")))
    with caplog.at_level("WARNING", logger=fastcall.__name__):
        assert fastcall.load() is None and fastcall.load() is None
    assert [r.getMessage() for r in caplog.records] == [
        "prunekit's fast-call module is unavailable (Ninja is required); eager calls use torch.ops"
    ]
    assert fastcall.loaded_path() is None


def test_key_depends_on_the_interpreter(monkeypatch):
    import sysconfig

    before = fastcall.key()
    real = sysconfig.get_config_var
    monkeypatch.setattr(sysconfig, "get_config_var", lambda n: ".cpython-399-x.so" if n == "EXT_SUFFIX" else real(n))
    assert fastcall.key() != before and fastcall.library_name().startswith("prunekit_fastcall_")


# Run in a child process: it defines the prunekit namespaces' operators, which must not leak into this one.
CHILD = textwrap.dedent(
    """
    import json, sys
    import torch
    from prunekit.kernels import fastcall

    schemas = json.loads(sys.argv[1])
    out = {"path": None, "missing": None, "calls": {}}
    module = fastcall.load()
    out["path"] = str(fastcall.loaded_path())
    try:  # before the operator exists: a clean error, and a later call retries the lookup
        module.linear(torch.zeros(2), torch.zeros(2), None, False, 0)
    except RuntimeError as exc:
        out["missing"] = str(exc).splitlines()[0]
    out["ready_before"] = [module.ready(name) for name in fastcall.ENTRIES] + [module.ready("nm_mm")]

    below = []  # per call: whether the autograd keys were excluded while the operator ran

    def echo(*args):  # every argument as a number: tensors by their sum, None as -1
        below.append(torch._C._dispatch_tls_is_dispatch_key_excluded(torch._C.DispatchKey.AutogradOther))
        vals = [-1.0 if a is None else float(a.sum()) if isinstance(a, torch.Tensor) else float(a) for a in args]
        return torch.tensor(vals, dtype=torch.float64)

    libs = {}
    for full, schema in schemas.items():
        ns, name = full.split("::")
        if ns not in libs:
            libs[ns] = torch.library.Library(ns, "FRAGMENT")
        libs[ns].define(schema)
        libs[ns].impl(name, echo, "CPU")

    def t(v):
        return torch.full((3,), float(v))

    args = {
        "bsr_mm": (t(1), t(2), t(3), None, t(5), t(6), 7, t(8), True, 10),
        "linear": (t(1), t(2), None, False, 5),
        "bitmap_linear": (t(1), t(2), t(3), True, 5, 6),
        "spmv24": (t(1), t(2), t(3), t(4), False, True),
        "spmm_csr_auto": (t(1), t(2), t(3), t(4), t(5), 6, None, True, 9),
    }
    out["ready_after"] = [module.ready(name) for name in fastcall.ENTRIES] + [module.ready("nm_mm")]
    for name, a in args.items():
        ns, op = fastcall.ENTRIES[name]
        fast = fastcall.entry(name)
        overload = getattr(getattr(torch.ops, ns), op).default
        call = out["calls"][name] = {
            "fast_is_module": fast is getattr(module, name),
            "fast": getattr(module, name)(*a).tolist(),
        }
        call["fast_below"] = below[-1]
        call["op"] = overload(*a).tolist()
        call["op_below"] = below[-1]
        # the first tensor argument requiring a gradient: the fast call keeps the autograd keys (torch's fallback
        # runs), except under no_grad
        g = (a[0].clone().requires_grad_(),) + a[1:]
        call["grad"] = getattr(module, name)(*g).detach().tolist()
        call["grad_below"] = below[-1]
        with torch.no_grad():
            getattr(module, name)(*g)
        call["no_grad_below"] = below[-1]
    print(json.dumps(out))
    """
)


@pytest.mark.skipif(
    shutil.which("ninja") is None or shutil.which("c++") is None, reason="needs a host C++ compiler and ninja"
)
def test_fast_entries_call_their_operators_with_the_same_arguments(tmp_path):
    env = {**__import__("os").environ, build.CACHE_ENV: str(tmp_path), build.PREBUILT_ENV: str(tmp_path / "none")}
    env.pop(fastcall.ENV, None)
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(registered_schemas())],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["path"].startswith(str(tmp_path)) and out["path"].endswith(".so")
    assert "prunekit_nm24::linear" in out["missing"]
    assert out["ready_before"] == [False] * 6 and out["ready_after"] == [True] * 5 + [False]
    expected = {
        "bsr_mm": [3, 6, 9, -1, 15, 18, 7, 24, 1, 10],
        "linear": [3, 6, -1, 0, 5],
        "bitmap_linear": [3, 6, 9, 1, 5, 6],
        "spmv24": [3, 6, 9, 12, 0, 1],
        "spmm_csr_auto": [3, 6, 9, 12, 15, 6, -1, 1, 9],
    }
    for name, want in expected.items():
        call = out["calls"][name]
        assert call["fast_is_module"], name
        assert call["fast"] == call["op"] == call["grad"] == want, name
        # no argument requiring a gradient: the fast call skips torch's autograd fallback (the OpOverload does not)
        assert call["fast_below"] and not call["op_below"], name
        assert not call["grad_below"] and call["no_grad_below"], name
    # a package's prebuilt copy (build.copy_prebuilt ships it) is imported without building: an empty cache here
    prebuilt = tmp_path / "prebuilt"
    prebuilt.mkdir()
    shutil.copy2(out["path"], prebuilt)
    env.update({build.CACHE_ENV: str(tmp_path / "empty-cache"), build.PREBUILT_ENV: str(prebuilt)})
    code = "from prunekit.kernels import fastcall; assert fastcall.load() is not None; print(fastcall.loaded_path())"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == str(prebuilt / Path(out["path"]).name)
    assert not (tmp_path / "empty-cache").exists()
