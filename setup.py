"""Install the project; compile the attention kernels where PyTorch has CUDA and nvcc exists.

Without them the install is pure Python (CPU machines, CI), and attention_cuda JIT-compiles the
kernels on first use if a GPU and nvcc turn up later. Knobs (environment variables):
  TORCH_CUDA_ARCH_LIST  GPU architectures to build for (default "8.0;9.0a"; 9.0a adds the Hopper
                        wgmma kernels, plain 9.0 runs the mma.sync ones on Hopper)
  ATTN_DTYPES           comma-separated subset of f16,bf16,f32 to compile (default all)
  ATTN_HEADDIMS         comma-separated subset of build.py's HEAD_DIMS (default all); narrow both for fast
                        development builds: inputs outside the build are reported as unsupported
  MAX_JOBS              parallel compile jobs (ninja)
What is compiled (dtypes, head dims, sources, flags) comes from attention_cuda/build.py, the build list
that the loader's JIT build and the tests read too; the per-(dtype, head dim) translation units are
generated from it into build/attention_cuda_gen/. Only the library installs: the app (train.py, model/,
data/) runs from the checkout.
"""
import importlib.util
import os
import shutil
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent


def _load_build_list():
    """attention_cuda/build.py by path: the package's __init__ imports torch, which need not be there."""
    spec = importlib.util.spec_from_file_location("_attention_cuda_build", ROOT / "attention_cuda" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build = _load_build_list()
CSRC = ROOT / "attention_cuda" / "csrc"
DTYPES = tuple(d.tag for d in build.DTYPES)
HEAD_DIMS = tuple(str(d) for d in build.HEAD_DIMS)


def _subset(var, allowed):
    picked = tuple(x.strip() for x in os.environ.get(var, "").split(",") if x.strip()) or allowed
    unknown = [x for x in picked if x not in allowed]
    if unknown:
        raise SystemExit(f"{var}: unknown {unknown}; expected a comma-separated subset of {','.join(allowed)}")
    return picked


def _pure_python(why: str):
    """No kernels in this install; say why. attention_cuda JIT-compiles them on first use on a GPU."""
    print(f"attention_cuda: {why}; installing pure Python (attention runs on the PyTorch reference; on a GPU "
          "with nvcc the kernels JIT-compile on first use)", file=sys.stderr)
    return [], {}


def _extension_sources():
    """The build's translation units (relative to ROOT, as setuptools wants them): the fixed ones under csrc
    and the instantiations of the selected (dtype, head dim) pairs, written into build.SETUP_GEN_DIR."""
    dtypes, head_dims = _subset("ATTN_DTYPES", DTYPES), _subset("ATTN_HEADDIMS", HEAD_DIMS)
    paths = build.sources(ROOT / build.SETUP_GEN_DIR, CSRC, dtypes, [int(d) for d in head_dims])
    return [p.relative_to(ROOT) for p in paths]


def _cuda_extension():
    """(ext_modules, cmdclass) for the kernels, or ([], {}) with the reason printed."""
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError:
        return _pure_python("torch is not importable at build time (pip without --no-build-isolation?)")
    if torch.version.cuda is None:
        return _pure_python("this torch has no CUDA")
    nvcc = shutil.which("nvcc") or (CUDA_HOME and os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc")))
    if not nvcc or CUDA_HOME is None:
        return _pure_python("nvcc not found")
    # torch takes CUDA_HOME from nvcc's folder: a wrapper script in /usr/local/bin gives /usr/local, where
    # no runtime headers are, and every .cu file would fail on cuda_runtime_api.h.
    if not os.path.isfile(os.path.join(CUDA_HOME, "include", "cuda_runtime_api.h")):
        return _pure_python(f"CUDA_HOME={CUDA_HOME} has no include/cuda_runtime_api.h (set CUDA_HOME to the "
                            "CUDA toolkit's root to build the kernels)")

    class OptionalBuild(BuildExtension):
        """A failed kernel build leaves a working pure-Python install, never a failed install."""

        def build_extensions(self):
            try:
                super().build_extensions()
            except Exception as err:  # noqa: BLE001 - compiler errors come as several exception types
                lines = [ln for ln in str(err).splitlines() if ln.strip()] or [type(err).__name__]
                _pure_python(f"the kernel build failed ({lines[0].strip()[:300]}; `pip install -v "
                             "--no-build-isolation -e .` shows the whole log)")
                self.extensions = []  # nothing to copy into the source tree or list as outputs

    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0a")
    nvcc_flags = build.nvcc_flags(os.environ["TORCH_CUDA_ARCH_LIST"], CSRC)
    # Absolute: ninja compiles from the build folder.
    include_dirs = [str(d) for d in build.include_dirs(CSRC)]
    ext = CUDAExtension("attention_cuda._C", [str(s) for s in _extension_sources()], include_dirs=include_dirs,
                        extra_compile_args={"cxx": ["-O3", *build.defines()], "nvcc": nvcc_flags})
    return [ext], {"build_ext": OptionalBuild}


ext_modules, cmdclass = _cuda_extension()
setup(
    name="attention-cuda-gpt",
    version="0.1.0",
    description="Cosine-sim, exp and fastmax attention for PyTorch, with CUDA kernels",
    packages=["attention_cuda"],
    # The kernel sources, so that an installed copy can JIT-compile them (the loader generates the
    # instantiations from build.py).
    package_data={"attention_cuda": list(build.PACKAGE_DATA)},
    python_requires=">=3.10",
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
