"""The kernels' build list (attention_cuda/build.py) against what reads it: setup.py, the loader's JIT build
and the generated instantiation files. CPU only: nothing is compiled."""
import fnmatch
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attention_cuda import _extension, build

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "attention_cuda" / "csrc"


def load_setup(monkeypatch):
    """setup.py as a module, with setuptools.setup captured instead of run."""
    import setuptools

    captured = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kw: captured.update(kw))
    spec = importlib.util.spec_from_file_location("_setup_under_test", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, captured


def test_build_list_loads_by_path_without_torch():
    code = ("import importlib.util, sys; "
            f"spec = importlib.util.spec_from_file_location('b', {str(ROOT / 'attention_cuda' / 'build.py')!r}); "
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
            "assert 'torch' not in sys.modules and 'attention_cuda' not in sys.modules; print(len(m.HEAD_DIMS))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(len(build.HEAD_DIMS))


def test_instantiations_cover_the_build_list_and_name_real_types():
    files = build.instantiations()
    assert len(files) == len(build.DTYPES) * len(build.HEAD_DIMS)
    enum = re.search(r"enum class Dtype \{([^}]*)\}", (CSRC / "common" / "params.h").read_text()).group(1)
    assert "#define ATTN_REGISTER(T, DTYPE, D, LINEAR)" in (CSRC / "binding" / "register.cuh").read_text()
    tiles = (CSRC / "quadratic" / "tiles.h").read_text()
    for d in build.DTYPES:
        assert d.enum in enum and isinstance(getattr(torch, d.torch), torch.dtype)
        for hd in build.HEAD_DIMS:
            text = files[f"{d.tag}_hd{hd}.cu"]
            assert '#include "binding/register.cuh"' in text
            assert f"ATTN_REGISTER({d.cpp}, {d.enum}, {hd}, {str(d.linear).lower()})" in text
    for hd in build.HEAD_DIMS:  # every head dim has its row in the tile table
        assert re.search(rf"^\s*\{{{hd},", tiles, re.M), hd
    assert [d.tag for d in build.DTYPES if d.linear] == ["f16", "bf16"]  # the linear form is 16-bit only


def test_no_hand_written_instantiations_and_every_source_installs(tmp_path):
    assert not (CSRC / "inst").exists()
    registers = [p for p in CSRC.rglob("*") if p.is_file() and "ATTN_REGISTER(" in p.read_text()]
    assert registers == [CSRC / "binding" / "register.cuh"]
    for s in build.FIXED_SOURCES:
        assert (CSRC / s).is_file(), s
    # The JIT build (torch's cpp_extension.load) names each object after its source's file name alone: two
    # sources of one name would both make rows.cuda.o, and ninja refuses the build.
    names = [p.name for p in build.sources(tmp_path)]
    assert len(names) == len(set(names)), names
    # package_data keeps every file under csrc, so that an installed copy can JIT-compile them.
    for f in (p for p in CSRC.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        rel = f.relative_to(CSRC.parent).as_posix()
        assert any(fnmatch.fnmatchcase(rel, pat) for pat in build.PACKAGE_DATA), rel


def test_written_instantiations_keep_their_mtime(tmp_path):
    first = build.write_instantiations(tmp_path, ["bf16"], [64, 128])
    assert [p.name for p in first] == ["bf16_hd64.cu", "bf16_hd128.cu"]
    stamps = [p.stat().st_mtime_ns for p in first]
    os.utime(first[0], ns=(1, 1))  # an older file with the same text stays as it is
    again = build.write_instantiations(tmp_path, ["bf16"], [64, 128])
    assert again == first and again[0].stat().st_mtime_ns == 1 and again[1].stat().st_mtime_ns == stamps[1]
    assert first[0].read_text() == build.instantiation_text(build.dtype("bf16"), 64)
    with pytest.raises(ValueError, match="head dims"):
        build.pairs(head_dims=[48])
    with pytest.raises(ValueError, match="dtype tag"):
        build.pairs(dtypes=["f64"])


def test_setup_installs_the_library_alone_and_compiles_the_build_list(monkeypatch):
    monkeypatch.delenv("ATTN_DTYPES", raising=False)
    monkeypatch.delenv("ATTN_HEADDIMS", raising=False)
    setup, kwargs = load_setup(monkeypatch)
    assert kwargs["packages"] == ["attention_cuda"]
    assert kwargs["package_data"] == {"attention_cuda": list(build.PACKAGE_DATA)}
    sources = setup._extension_sources()
    gen = build.SETUP_GEN_DIR
    expected = [f"attention_cuda/csrc/{s}" for s in build.FIXED_SOURCES]
    expected += [(gen / n).as_posix() for n in build.instantiations()]
    assert [s.as_posix() for s in sources] == expected
    for s in sources:
        assert (ROOT / s).is_file()
    for name, text in build.instantiations().items():
        assert (ROOT / gen / name).read_text() == text
    assert str(CSRC) in [str(d) for d in build.include_dirs()]
    assert build.nvcc_flags("8.0;9.0a")[-1] == "-DATTN_SM90A" and "-DATTN_SM90A" not in build.nvcc_flags("8.0")

    monkeypatch.setenv("ATTN_DTYPES", "bf16")
    monkeypatch.setenv("ATTN_HEADDIMS", "64,128")
    narrowed = [s.name for s in setup._extension_sources()]
    assert narrowed == [Path(s).name for s in build.FIXED_SOURCES] + ["bf16_hd64.cu", "bf16_hd128.cu"]
    monkeypatch.setenv("ATTN_HEADDIMS", "48")
    with pytest.raises(SystemExit, match="ATTN_HEADDIMS"):
        setup._extension_sources()


def test_loader_constants_follow_the_build_list():
    assert tuple(_extension.HEAD_DIMS) == build.HEAD_DIMS
    assert tuple(_extension.DTYPES) == tuple(getattr(torch, d.torch) for d in build.DTYPES)


def test_loader_jit_build_compiles_the_build_list(monkeypatch, tmp_path):
    from torch.utils import cpp_extension

    calls = []
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: calls.append(kw))
    _extension._jit_build()
    (kw,) = calls
    names = [Path(s).name for s in kw["sources"]]
    assert names == [Path(s).name for s in build.FIXED_SOURCES] + list(build.instantiations())
    for s in kw["sources"]:
        assert Path(s).is_file()
    for s, (name, text) in zip(kw["sources"][len(build.FIXED_SOURCES):], build.instantiations().items()):
        assert Path(s).read_text() == text
    assert str(CSRC) in [str(p) for p in kw["extra_include_paths"]]
    assert kw["extra_cuda_cflags"] == build.nvcc_flags("9.0a")
