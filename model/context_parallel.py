"""Context parallelism for the model: one sequence split across the ranks of a process group, each rank holding
its slice. This module cuts the sequences (shard_sequence, in plain or zigzag order: context_zigzag decides
which), says what can run so, and adds up the loss. The attention across ranks is each family's
(model.attention.FAMILIES): cosine-sim's ring and fastmax's exchange of states from attention_cuda.context_parallel,
which also defines the layout, and softmax on PyTorch's own context-parallel SDPA (model.softmax_ring).
docs/context_parallel.md says how, and what the GPUs still have to show.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from attention_cuda.context_parallel import rank_chunks
from model.attention import family
from model.softmax_ring import RING_BACKENDS, RING_DEVICE


def shard_sequence(x: torch.Tensor, rank: int, world_size: int, *, zigzag: bool = False):
    """Rank's slice of x (B, T, ...) along T and the positions (T / world_size,) it holds, for RoPE: its
    rows are cos[positions], sin[positions] (in plain order a start offset of positions[0])."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank: expected 0 <= rank < world_size={world_size}, got {rank}")
    chunks = 2 * world_size if zigzag else world_size
    if x.dim() < 2 or x.shape[1] % chunks:
        raise ValueError(f"x: expected (B, T, ...) with T divisible by {chunks} (the chunks of world_size="
                         f"{world_size}{' in zigzag order' if zigzag else ''}), got shape {tuple(x.shape)}")
    size = x.shape[1] // chunks
    positions = torch.cat([torch.arange(c * size, (c + 1) * size, device=x.device)
                           for c in rank_chunks(rank, world_size, zigzag)])
    return x[:, positions], positions


def context_zigzag(cfg, size: int) -> bool:
    """Whether a model of cfg (a GPTConfig) splits its sequences over ``size`` ranks in zigzag order, or
    ValueError naming what cannot run context-parallel. The one place that decides what a model's context
    parallelism supports, for the model and for train.py's --context-parallel alike."""
    if cfg.attention == "softmax" and cfg.sdpa_backend not in RING_BACKENDS:
        raise ValueError(f"sdpa_backend: softmax across ranks runs on PyTorch's context-parallel SDPA, whose ring "
                         f"takes SDPA's flash and cuDNN kernels; expected one of {tuple(RING_BACKENDS)}, "
                         f"got {cfg.sdpa_backend!r}")
    if cfg.cosine_sdpa:
        raise ValueError("cosine_sdpa: context parallelism computes cosine's blocks on our kernels or the PyTorch "
                         "reference, not on SDPA; leave cosine_sdpa off")
    if cfg.swa_window:
        raise ValueError("swa_window: the ring passes whole slices of keys to every rank and implements no "
                         "sliding window, so the windowed blocks cannot run context-parallel; expected 0, "
                         f"got {cfg.swa_window}")
    if cfg.short_conv:
        raise ValueError(f"short_conv: a slice's first positions would need the previous rank's last inputs, which "
                         f"context parallelism does not pass; expected 0, got {cfg.short_conv}")
    zigzag = family(cfg).zigzag
    chunks = 2 * size if zigzag else size
    if cfg.seq_len % chunks:
        raise ValueError(f"seq_len: context parallelism over {size} ranks cuts each sequence into {chunks} chunks "
                         f"({'zigzag order, ' if zigzag else ''}{cfg.attention}), expected a multiple of {chunks}, "
                         f"got {cfg.seq_len}")
    return zigzag


def context_device_problem(cfg, device: torch.device) -> str | None:
    """Why a model of cfg cannot run context-parallel on device, or None: what context_zigzag cannot tell from
    the config alone, for ContextParallel and for train.py (which asks before it starts any process group)."""
    if cfg.attention == "softmax" and device.type != RING_DEVICE:
        return (f"device: softmax across ranks runs on PyTorch's context-parallel SDPA, whose ring takes SDPA's "
                f"flash and cuDNN kernels, on {RING_DEVICE}; got {device}")
    return None


class ContextParallel:
    """A model's place in a context-parallel group: the slice of each sequence this rank holds, attention
    over the group's ranks, and this rank's share of the loss. ``device``: the model's."""

    def __init__(self, cfg, group, device: torch.device):
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.zigzag = context_zigzag(cfg, self.size)
        problem = context_device_problem(cfg, device)
        if problem is not None:
            raise ValueError(problem)
        self.attend = family(cfg).across_ranks(cfg, group, device)

    def shard(self, x: torch.Tensor):
        """This rank's slice of x (B, T, ...) and its positions."""
        return shard_sequence(x, self.rank, self.size, zigzag=self.zigzag)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor, reduction: str) -> torch.Tensor:
        """This rank's share of the loss of the whole targets (B, T), given the logits of its slice: "mean",
        the summed cross-entropy of its slice's targets over the count of all targets, so that the shares
        add up over the group to the whole mean and their gradients to its gradient; "none", the per-token
        loss (B, T) of the whole sequence, the same on every rank, for evaluation by position (no gradient:
        training takes the mean)."""
        mine, positions = self.shard(targets)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), mine.flatten(), reduction="none").view_as(mine)
        if reduction == "mean":
            # Every rank holds the whole targets, so the count needs no exchange (-100: cross_entropy's ignore_index).
            return loss.sum() / targets.ne(-100).sum()
        whole = loss.detach().new_zeros(targets.shape).index_copy(1, positions, loss.detach())
        dist.all_reduce(whole, group=self.group)
        return whole
