"""python -m attention_cuda: which attention code this install runs, and why (make install prints it last).

It only looks: on a GPU without prebuilt kernels it does not start the JIT build that a first call would.
"""
import importlib.util

import torch


def status() -> str:
    prebuilt = importlib.util.find_spec(f"{__package__}._C")
    if prebuilt is not None:
        where = "on this GPU" if torch.cuda.is_available() else "once a CUDA GPU is visible (none is now)"
        return f"attention_cuda: prebuilt kernels ({prebuilt.origin}), used {where}"
    if torch.version.cuda is None:
        return (f"attention_cuda: torch {torch.__version__} has no CUDA, so attention runs on the PyTorch "
                "reference (pure Python install)")
    return ("attention_cuda: no prebuilt kernels (nvcc missing or the build failed at install: `pip install -v "
            "--no-build-isolation -e .` shows why); on a GPU they JIT-compile on first use, else attention runs "
            "on the PyTorch reference")


if __name__ == "__main__":
    print(status())
