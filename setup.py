"""Install the project; compile the attention kernels where PyTorch has CUDA and nvcc exists.

Without them the install is pure Python (CPU machines, CI), and attention_cuda JIT-compiles the
kernels on first use if a GPU and nvcc turn up later. Knobs (environment variables):
  TORCH_CUDA_ARCH_LIST  GPU architectures to build for (default "8.0;9.0a"; 9.0a adds the Hopper
                        wgmma kernels, plain 9.0 runs the mma.sync ones on Hopper)
  ATTN_DTYPES           comma-separated subset of f16,bf16,f32 to compile (default all)
  ATTN_HEADDIMS         comma-separated subset of 16,32,64,96,128 (default all); narrow both for fast
                        development builds: inputs outside the build are reported as unsupported
  MAX_JOBS              parallel compile jobs (ninja)
"""
import os
import shutil
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).parent
CSRC = Path("attention_cuda") / "csrc"
DTYPES = ("f16", "bf16", "f32")
HEAD_DIMS = ("16", "32", "64", "96", "128")


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
    sources = [CSRC / "binding.cpp", CSRC / "aux.cu"]
    sources += [CSRC / "inst" / f"{t}_hd{d}.cu" for t in _subset("ATTN_DTYPES", DTYPES)
                for d in _subset("ATTN_HEADDIMS", HEAD_DIMS)]
    nvcc_flags = (ROOT / CSRC / "nvcc_flags.txt").read_text().split()
    if "9.0a" in os.environ["TORCH_CUDA_ARCH_LIST"]:
        nvcc_flags.append("-DATTN_SM90A")  # the host side may launch the sm_90a kernels
    ext = CUDAExtension("attention_cuda._C", [str(s) for s in sources],
                        extra_compile_args={"cxx": ["-O3"], "nvcc": nvcc_flags})
    return [ext], {"build_ext": OptionalBuild}


ext_modules, cmdclass = _cuda_extension()
setup(
    name="attention-cuda-gpt",
    version="0.1.0",
    description="Cosine-sim, exp and fastmax attention kernels and a character-level GPT on enwik8",
    packages=["attention_cuda", "model", "data"],
    package_data={"attention_cuda": ["csrc/*.cpp", "csrc/*.h", "csrc/*.cuh", "csrc/*.cu", "csrc/*.txt",
                                     "csrc/inst/*.cu"]},
    python_requires=">=3.10",
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
