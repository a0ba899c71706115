"""The attention variants that train.py and every driver (compare.py, scripts/throughput.py,
scripts/context_limit.py) speak of: a name, a label for tables and plots, and the config fields that
select it. A variant is config, not code: ``python train.py --attention cosine --use-cuda-kernel`` and
the variant "cosine-kernel" are the same run.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Variant:
    name: str
    label: str
    settings: tuple[tuple[str, object], ...]  # (config field, value) pairs

    def flags(self) -> list[str]:
        """The settings as train.py flags."""
        return [arg for field, value in self.settings for arg in (f"--{field}", str(value))]


def _variant(name: str, label: str, **settings) -> Variant:
    return Variant(name, label, tuple(settings.items()))


VARIANTS = {v.name: v for v in (
    _variant("softmax", "softmax (SDPA)", attention="softmax"),
    _variant("softmax-cudnn", "softmax (SDPA, cuDNN)", attention="softmax", sdpa_backend="cudnn"),
    _variant("cosine", "cosine (PyTorch reference)", attention="cosine", use_cuda_kernel=False),
    _variant("cosine-sdpa", "cosine (SDPA, cuDNN, on l2-normalised q, k)", attention="cosine", cosine_sdpa=True,
             sdpa_backend="cudnn"),
    _variant("cosine-kernel", "cosine (our kernels)", attention="cosine", use_cuda_kernel=True),
    _variant("fastmax", "fastmax (PyTorch reference)", attention="fastmax", use_cuda_kernel=False),
    _variant("fastmax-kernel", "fastmax (our kernels)", attention="fastmax", use_cuda_kernel=True),
    # Based's hybrid: every other block exact softmax over the last 64 bytes, the local statistics fastmax
    # learns poorly, the fastmax blocks left the long range (GPTConfig.swa_window).
    _variant("fastmax-swa", "fastmax + sliding-window softmax (our kernels; Based)", attention="fastmax",
             use_cuda_kernel=True, swa_window=64),
)}
# The fields the variants set: a config's variant is the one whose settings it has.
FIELDS = ("attention", "use_cuda_kernel", "cosine_sdpa", "sdpa_backend", "swa_window")


def variant_of(cfg) -> Variant:
    """The registered variant cfg runs: the one whose settings cfg has, the other variant fields as a config of
    that variant alone settles them (softmax with a forced flash backend, say, has none)."""
    for variant in VARIANTS.values():
        wanted = type(cfg)(**dict(variant.settings))
        if all(getattr(cfg, f) == getattr(wanted, f) for f in FIELDS):
            return variant
    settings = ", ".join(f"{f}={getattr(cfg, f)!r}" for f in FIELDS)
    raise ValueError(f"no registered attention variant has {settings} (model/variants.py lists them)")
