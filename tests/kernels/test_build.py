"""Build-cache key, arch flags, variant planning, and the KernelUnavailable path (all CPU)."""

from __future__ import annotations

import shutil
from concurrent.futures import Future

import pytest
import torch

from prunekit.errors import KernelUnavailable, PrunekitError
from prunekit.kernels import build, gpu


def test_build_key_changes_with_every_input():
    base = build.build_key("s" * 64, "2.11.0+cu130", "13.0", ("80", "90"))
    assert len(base) == 64 and base == build.build_key("s" * 64, "2.11.0+cu130", "13.0", ("80", "90"))
    assert base != build.build_key("t" * 64, "2.11.0+cu130", "13.0", ("80", "90"))
    assert base != build.build_key("s" * 64, "2.12.0+cu130", "13.0", ("80", "90"))
    assert base != build.build_key("s" * 64, "2.11.0+cu130", "12.8", ("80", "90"))
    assert base != build.build_key("s" * 64, "2.11.0+cu130", "13.0", ("80", "89", "90"))
    assert build.library_name(base).startswith("prunekit_kernels_") and base[:16] in build.library_name(base)


def test_source_digest_follows_source_bytes(tmp_path):
    csrc = tmp_path / "csrc"
    shutil.copytree(build.CSRC_DIR, csrc)
    before = build.source_digest(csrc)
    assert before == build.source_digest(build.CSRC_DIR)
    path = csrc / build.SOURCES[1]
    path.write_text(path.read_text() + "\n// edit\n")
    assert build.source_digest(csrc) != before


def test_target_archs_default_env_and_device(monkeypatch):
    monkeypatch.delenv(build.ARCHS_ENV, raising=False)
    assert build.target_archs(None) == ("80", "90")
    assert build.target_archs((9, 0)) == ("80", "90")
    assert build.target_archs((8, 9)) == ("80", "89", "90")
    assert build.target_archs((7, 5)) == ("80", "90")
    monkeypatch.setenv(build.ARCHS_ENV, "9.0")
    assert build.target_archs((8, 9)) == ("90",)


def test_gencode_flags_name_every_arch_and_ptx_for_the_newest():
    flags = build.gencode_flags(("80", "90"))
    assert "-gencode=arch=compute_80,code=sm_80" in flags
    assert "-gencode=arch=compute_90,code=sm_90" in flags
    assert flags[-1] == "-gencode=arch=compute_90,code=compute_90"


def test_cache_root_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path / "kc"))
    assert build.cache_root() == tmp_path / "kc"
    monkeypatch.delenv(build.CACHE_ENV)
    assert build.cache_root().parts[-3:] == (".cache", "prunekit", "kernels")


def test_prebuilt_library_is_found_by_key(monkeypatch, tmp_path):
    key = "ab" * 32
    monkeypatch.setenv(build.PREBUILT_ENV, str(tmp_path))
    assert build._prebuilt(key) is None
    (tmp_path / f"{build.library_name(key)}.so").write_bytes(b"")
    assert build._prebuilt(key) == tmp_path / f"{build.library_name(key)}.so"


def test_copy_prebuilt_copies_the_loaded_library_under_its_key_name(monkeypatch, tmp_path):
    assert build.copy_prebuilt(tmp_path / "none") is None or build.loaded_library() is not None
    lib = tmp_path / "cache" / f"{build.library_name('cd' * 32)}.so"
    lib.parent.mkdir()
    lib.write_bytes(b"\x7fELF fake")
    monkeypatch.setitem(build._registry, build.MAIN.namespace, lib)
    copied = build.copy_prebuilt(tmp_path / "pkg" / "runtime" / "prebuilt")
    assert copied == tmp_path / "pkg" / "runtime" / "prebuilt" / lib.name
    assert copied.read_bytes() == lib.read_bytes()
    monkeypatch.setenv(build.PREBUILT_ENV, str(copied.parent))
    assert build._prebuilt("cd" * 32) == copied


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error path")
def test_load_without_gpu_raises_one_sentence_kernel_unavailable():
    with pytest.raises(KernelUnavailable) as info:
        build.load()
    message = str(info.value)
    assert isinstance(info.value, PrunekitError)
    assert "unavailable" in message and "\n" not in message and message.endswith(".")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error path")
def test_gpu_launchers_raise_kernel_unavailable_without_gpu():
    with pytest.raises(KernelUnavailable):
        gpu.spmm_csr(
            torch.zeros(0),
            torch.zeros(1, dtype=torch.int32),
            torch.zeros(0, dtype=torch.int16),
            torch.zeros(0, dtype=torch.int32),
            torch.zeros(0, 1),
            0,
        )
    with pytest.raises(KernelUnavailable):
        gpu.sddmm_csr(
            torch.zeros(1, dtype=torch.int32),
            torch.zeros(0, dtype=torch.int16),
            torch.zeros(0, dtype=torch.int32),
            torch.zeros(0, 2),
            torch.zeros(0, 2),
        )


def test_importing_kernels_needs_no_gpu_or_compiler():
    import importlib

    for name in ("ops", "build", "gpu", "check", "layout", "reference", "testing"):
        importlib.import_module(f"prunekit.kernels.{name}")
    reason = build.unavailable_reason()
    assert reason is None or (isinstance(reason, str) and "\n" not in reason)


@pytest.mark.parametrize(
    "m,k,n,nnz,expect",
    [
        (4096, 4096, 1, 4096 * 416, gpu.SpmmPlan("rowwarp", subwarp=32, ntile=1, stage_x=False)),
        (4096, 4096, 3, 4096 * 416, gpu.SpmmPlan("rowwarp", subwarp=32, ntile=4, stage_x=False)),
        (768, 3072, 7, 768 * 64, gpu.SpmmPlan("rowwarp", subwarp=8, ntile=8, stage_x=False)),
        (768, 3072, 16, 768 * 64, gpu.SpmmPlan("rowwarp", subwarp=8, ntile=16, stage_x=False)),
        (768, 3072, 64, 768 * 1536, gpu.SpmmPlan("rowwarp", subwarp=32, ntile=16, stage_x=False)),
        (4096, 4096, 32, 4096 * 416, gpu.SpmmPlan("rowwarp", subwarp=32, ntile=16, stage_x=True)),
        (4096, 4096, 32, 4096 * 88, gpu.SpmmPlan("rowwarp", subwarp=8, ntile=16, stage_x=False)),
        (4096, 4096, 2048, 4096 * 1232, gpu.SpmmPlan("direct")),
        (768, 3072, 128, 768 * 88, gpu.SpmmPlan("direct")),
    ],
)
def test_plan_spmm_auto(m, k, n, nnz, expect):
    assert gpu.plan_spmm(m, k, n, nnz, num_sms=132) == expect


def test_plan_spmm_forced_tiled_picks_block_height():
    assert gpu.plan_spmm(4096, 4096, 2048, 10, variant="tiled") == gpu.SpmmPlan("tiled", rows_per_warp=8)
    assert gpu.plan_spmm(768, 3072, 256, 10, variant="tiled") == gpu.SpmmPlan("tiled", rows_per_warp=2)


def test_plan_spmm_forced_and_unknown_variant():
    assert gpu.plan_spmm(4096, 4096, 4096, 10, variant="rowwarp") == gpu.SpmmPlan("rowwarp", subwarp=8, stage_x=True)
    assert gpu.plan_spmm(4096, 4096, 16, 10, variant="rowwarp_global").stage_x is False
    assert gpu.plan_spmm(4096, 4096, 16, 10**9, variant="direct") == gpu.SpmmPlan("direct")
    assert gpu.plan_spmm(4096, 4096, 1, 10, variant="tiled").variant == "tiled"
    with pytest.raises(ValueError, match="unknown spmm variant"):
        gpu.plan_spmm(1, 1, 1, 1, variant="fast")


def test_every_extension_has_its_own_namespace_prefix_and_existing_sources():
    exts = build.extensions()
    assert exts[0] is build.MAIN
    assert len({e.namespace for e in exts}) == len(exts) and len({e.prefix for e in exts}) == len(exts)
    for ext in exts:
        for name in ext.sources + ext.headers:
            assert (ext.csrc_dir / name).is_file(), (ext.namespace, name)
        assert ext.library_name(("90",)).startswith(ext.prefix + "_")


def test_extension_key_follows_sources_flags_archs_and_extra(tmp_path):
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    (csrc / "a.cu").write_text("// a\n")
    ext = build.Extension(namespace="ns_t", prefix="ns_t", csrc_dir=csrc, sources=("a.cu",), probe="x")
    base = ext.key(("80", "90"))
    assert base == ext.key(("80", "90")) and base != ext.key(("90",))
    from dataclasses import replace

    assert base != replace(ext, cuda_cflags=("-O2",)).key(("80", "90"))
    assert base != replace(ext, key_extra="lib/v2").key(("80", "90"))
    assert replace(ext, gencode=False).key(("80",)) == replace(ext, gencode=False).key(("90",))
    (csrc / "a.cu").write_text("// b\n")
    assert ext.key(("80", "90")) != base


def test_copy_prebuilt_ships_every_loaded_shippable_library_and_skips_the_rest(monkeypatch, tmp_path):
    from prunekit.kernels import fastcall

    monkeypatch.setattr(fastcall, "_state", {})  # no fast-call module loaded (the next test ships one)
    libs = {}
    for ext in build.extensions():
        lib = tmp_path / "cache" / f"{ext.library_name(('90',))}.so"
        lib.parent.mkdir(exist_ok=True)
        lib.write_bytes(ext.namespace.encode())
        monkeypatch.setitem(build._registry, ext.namespace, lib)
        libs[ext.namespace] = (ext, lib)
    dest = tmp_path / "pkg" / "prebuilt"
    main_copy = build.copy_prebuilt(dest)
    assert main_copy == dest / libs[build.MAIN.namespace][1].name
    shipped = {p.name for p in dest.iterdir()}
    assert shipped == {lib.name for ext, lib in libs.values() if ext.prebuilt}
    assert any(not ext.prebuilt for ext, _ in libs.values())  # the SpDNN kernel stays out of packages


def test_copy_prebuilt_ships_the_fast_call_module_beside_the_libraries(monkeypatch, tmp_path):
    from prunekit.kernels import fastcall

    module = tmp_path / "cache" / f"{fastcall.library_name()}.so"
    module.parent.mkdir()
    module.write_bytes(b"module")
    monkeypatch.setattr(fastcall, "_state", {"module": object(), "path": module})
    monkeypatch.setattr(build, "_registry", {})
    dest = tmp_path / "pkg" / "prebuilt"
    assert build.copy_prebuilt(dest) == dest / module.name  # the only file copied
    assert [p.name for p in dest.iterdir()] == [module.name] and (dest / module.name).read_bytes() == b"module"


def test_find_prebuilt_looks_up_the_library_by_its_key(monkeypatch, tmp_path):
    ext = build.extensions()[1]
    monkeypatch.setenv(build.PREBUILT_ENV, str(tmp_path))
    monkeypatch.setenv(build.ARCHS_ENV, "90")
    assert build.find_prebuilt(ext) is None
    (tmp_path / f"{ext.library_name()}.so").write_bytes(b"")
    assert build.find_prebuilt(ext) == tmp_path / f"{ext.library_name()}.so"


def test_arch_specific_extensions_compile_sm90a_sass_and_keep_portable_ptx():
    flags = build.gencode_flags(("80", "90"), arch_specific=True)
    assert "-gencode=arch=compute_80,code=sm_80" in flags
    assert "-gencode=arch=compute_90a,code=sm_90a" in flags
    assert flags[-1] == "-gencode=arch=compute_90,code=compute_90"
    from prunekit.kernels import structured

    assert structured.EXTENSION.arch_specific and "-gencode=arch=compute_90a,code=sm_90a" in (
        structured.EXTENSION.nvcc_flags(("80", "90"))
    )


def test_spmv_takes_mirrors_the_kernel_limits(monkeypatch):
    """CPU: the launcher skips rowwarp's row-major copy of X exactly where the SpMV kernel runs (N = 1 with X within 96
    KB; N = 2-4 with X's 4-token copy within 48 KB and 8 rows per SM; $PRUNEKIT_SPMV not 0)."""
    monkeypatch.delenv(gpu.SPMV_ENV, raising=False)
    assert gpu.spmv_takes(1, 49152, 1, 2) and not gpu.spmv_takes(1, 49153, 1, 2)
    assert gpu.spmv_takes(1056, 6144, 4, 2) and not gpu.spmv_takes(1056, 6145, 2, 2)
    assert not gpu.spmv_takes(1055, 4096, 3, 2) and gpu.spmv_takes(528, 4096, 3, 2, num_sms=66)
    assert gpu.spmv_takes(4096, 3072, 2, 4) and not gpu.spmv_takes(4096, 3073, 2, 4)
    assert not gpu.spmv_takes(4096, 4096, 5, 2) and not gpu.spmv_takes(1, 0, 1, 2) and not gpu.spmv_takes(1, 64, 0, 2)
    monkeypatch.setenv(gpu.SPMV_ENV, "0")
    assert not gpu.spmv_takes(4096, 4096, 1, 2)


def test_jobs_per_build_shares_the_cpus_unless_max_jobs_is_set():
    assert build.jobs_per_build(5, cpus=16, env="") == 7  # 32 / 5, rounded up
    assert build.jobs_per_build(1, cpus=16, env="") == 16  # never more than the CPUs
    assert build.jobs_per_build(6, cpus=2, env="") == 1
    assert build.jobs_per_build(5, cpus=16, env="4") == 4
    for bad in ("0", "x", "-2"):
        with pytest.raises(ValueError, match="MAX_JOBS"):
            build.jobs_per_build(2, cpus=16, env=bad)


def _fake_machine(monkeypatch, tmp_path, cached: set[str]):
    """build_many's view of a machine with a GPU and a compiler whose kernel cache holds the libraries in ``cached``;
    load_extension records the namespaces it is asked for, in order."""
    loaded: list[str] = []
    monkeypatch.setattr(build, "unavailable_reason", lambda need_compiler=True: None)
    monkeypatch.setattr(build, "_built", lambda ext: ext.namespace in cached)
    monkeypatch.setattr(build, "extension_loaded", lambda ext: False)
    monkeypatch.setattr(build, "find_prebuilt", lambda ext, archs=None: None)
    monkeypatch.setattr(build, "load_extension", lambda ext, verbose=False: loaded.append(ext.namespace) or tmp_path)
    return loaded


def _extensions(names):
    from dataclasses import replace

    return [replace(build.MAIN, namespace=n, prefix=n) for n in names]


def test_build_many_loads_every_library_in_order_and_skips_the_pool_when_nothing_needs_two_builds(
    monkeypatch, tmp_path
):
    loaded = _fake_machine(monkeypatch, tmp_path, cached={"a", "c"})

    def no_pool(*args, **kwargs):
        raise AssertionError("one library to build needs no process pool")

    monkeypatch.setattr(build, "ProcessPoolExecutor", no_pool)
    paths = build.build_many(_extensions(["a", "b", "c"]))
    assert loaded == ["a", "b", "c"] and paths == {"a": tmp_path, "b": tmp_path, "c": tmp_path}


def test_build_many_builds_the_uncached_libraries_side_by_side_then_loads_all(monkeypatch, tmp_path):
    loaded = _fake_machine(monkeypatch, tmp_path, cached={"b"})
    submitted: list[tuple[str, int]] = []

    class Pool:
        def __init__(self, max_workers, mp_context):
            assert max_workers == 2 and mp_context.get_start_method() == "spawn"

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def submit(self, fn, ext, jobs, verbose):
            submitted.append((ext.namespace, jobs))
            future = Future()
            if ext.namespace == "c":
                future.set_exception(KernelUnavailable("building prunekit's c failed (nvcc error)."))
            elif ext.namespace == "d":
                future.set_exception(RuntimeError("A process in the process pool was terminated abruptly"))
            else:
                future.set_result("ok")
            return future

    monkeypatch.setattr(build, "ProcessPoolExecutor", Pool)
    monkeypatch.setattr(build.os, "cpu_count", lambda: 16)
    monkeypatch.delenv("MAX_JOBS", raising=False)
    build.build_many(_extensions(["a", "b"]))
    assert submitted == []  # one uncached library: built by load_extension in this process, no pool
    submitted.clear()
    with pytest.raises(KernelUnavailable, match="c failed"):
        build.build_many(_extensions(["a", "b", "c"]))
    assert submitted == [("a", 16), ("c", 16)]  # both builds ran to their end before the failure was raised
    assert loaded == ["a", "b"]  # the first call loaded both; the failed one loads nothing
    with pytest.raises(KernelUnavailable, match=r"failed \(A process in the process pool.*MAX_JOBS=2"):
        build.build_many(_extensions(["d", "b", "a"]))  # a build process that died: one sentence, no traceback


def test_build_many_sequential_and_without_gpu(monkeypatch, tmp_path):
    from prunekit.kernels import check

    loaded = _fake_machine(monkeypatch, tmp_path, cached=set())
    build.build_many(_extensions(["a", "b"]), parallel=False)
    assert loaded == ["a", "b"]
    monkeypatch.setattr(build, "unavailable_reason", lambda need_compiler=True: "no CUDA GPU is visible to torch")
    with pytest.raises(KernelUnavailable, match="^prunekit's CUDA kernels are unavailable: no CUDA GPU"):
        build.build_many(_extensions(["a"]))
    names = [e.namespace for e in check.required_extensions()]
    assert names[:3] == ["prunekit_ext", "prunekit_structured", "prunekit_nm24"]
