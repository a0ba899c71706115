"""Drop-in for the original Fastmax ``FASTMultiHeadAttention`` module, on our fastmax_attention."""
from __future__ import annotations

import warnings

import torch
from torch import nn

from .functional import fastmax_attention


class FastMultiHeadAttention(nn.Module):
    """Accepts the original call ``(q, k, v, drop_noise, rpe_matrix, mask, dropout, normalize,
    temperature, a0, a1, a2, lim, p)`` with q, k, v as (b*h, n, d) or (b, h, n, d).

    Differences from the original, each deliberate:
    - ``mask`` is the causal flag (a bool), as there; for key padding call ``fastmax_attention``.
    - ``rpe_matrix`` must be None or all zeros (the original's "no RPE"); use RoPE on q and k instead.
    - ``normalize`` scales each q and k row to norm ``lim`` (the original divided by the largest norm
      over the sequence, which lets future tokens change past outputs under causal masking), and
      ``temperature`` still applies.
    - ``drop_noise`` is not read: dropout masks come from torch's generator (``torch.manual_seed``).
    - ``use_custom_gradient=True`` runs our fused kernels with their own backward where they apply
      (``backend="auto"``); False runs the PyTorch reference under autograd.
    """

    def __init__(self, use_custom_gradient: bool = True):
        super().__init__()
        self.use_custom_gradient = use_custom_gradient

    def forward(self, q, k, v, drop_noise=None, rpe_matrix=None, mask=False, dropout=0.0,
                normalize=False, temperature=1.0, a0=1.0, a1=1.0, a2=0.5, lim=1.0, p=2):
        if not isinstance(mask, bool):
            raise ValueError("mask: FastMultiHeadAttention takes the causal flag (a bool) as the original "
                             "did; for a key-padding mask call attention_cuda.fastmax_attention(mask=...)")
        if rpe_matrix is not None and (not torch.is_tensor(rpe_matrix) or bool(rpe_matrix.any())):
            raise NotImplementedError("rpe_matrix: relative positional encodings are not supported; "
                                      "apply RoPE to q and k before the call (an all-zero matrix is accepted)")
        if drop_noise is not None and dropout > 0:
            warnings.warn("drop_noise is not used: dropout masks come from torch's random generator",
                          stacklevel=2)
        return fastmax_attention(q, k, v, causal=mask, p=p, a0=a0, a1=a1, a2=a2, temperature=temperature,
                                 normalize=normalize, lim=lim, dropout=dropout,
                                 backend="auto" if self.use_custom_gradient else "torch")
