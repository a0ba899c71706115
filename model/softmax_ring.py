"""Softmax across the ranks of a context group, on PyTorch's own context-parallel SDPA (its ring attention): the
baseline's like for like, beside attention_cuda.context_parallel's cosine ring and fastmax exchange. A rank holds
its slice of the sequence in zigzag order (attention_cuda.context_parallel.rank_chunks), which is PyTorch's
head-tail order."""
from __future__ import annotations

import torch
import torch.distributed.tensor.experimental._attention as torch_cp
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.nn.attention import SDPBackend, sdpa_kernel

from attention_cuda.context_parallel import check_slices


# The SDPA kernels PyTorch's context parallelism sends round its ring (its DTensor handler takes their ops), by
# sdpa_backend. Not "math": that is SDPA spelled in ordinary ops, which DTensor cannot run on sequence shards. Not
# "efficient" either: under the ring it failed its 2-GPU test against float64 (bf16 and fp16, session 37;
# docs/context_parallel.md), where flash and cuDNN pass.
RING_BACKENDS = {"auto": [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION],
                 "flash": [SDPBackend.FLASH_ATTENTION], "cudnn": [SDPBackend.CUDNN_ATTENTION]}
# Those kernels are CUDA's: on a CPU SDPA runs an op of its own, which PyTorch's ring does not take.
RING_DEVICE = "cuda"
# How the ring moves K/V: "alltoall" passes each block to the next rank, one step at a time, as cosine's ring does
# ("allgather", PyTorch's default, gathers all W blocks at once on every rank).
RING_ROTATION = "alltoall"


def softmax_mesh(group, device: torch.device) -> DeviceMesh:
    """The 1-D DeviceMesh of group's ranks (on device's type) that softmax_context_parallel takes, with PyTorch's
    context-parallel SDPA switched on. That switch is PyTorch's and process-wide: from now on SDPA on any DTensor
    sharded along the sequence runs as its ring, and only softmax_context_parallel makes such tensors here.

    The public torch.distributed.tensor.experimental.context_parallel() is a with-block that shards given buffers
    itself and patches F.scaled_dot_product_attention while it lasts, forward and backward; the model shards its
    own slices and calls SDPA on DTensors, so it takes the switch beneath that (private, as are the options below;
    the same in torch 2.11 and 2.13)."""
    # PyTorch's ring balances causal work by head-tail order: rank r holds chunks r and 2W-1-r, which is our
    # zigzag (its mesh rank is our group rank: the mesh is the group's own).
    torch_cp._cp_options.enable_load_balance = True
    torch_cp.set_rotate_method(RING_ROTATION)
    torch_cp._enable_context_parallel_dispatcher()
    return DeviceMesh.from_group(group, device.type)


def softmax_context_parallel(q, k, v, mesh: DeviceMesh, *, backend: str = "auto"):
    """F.scaled_dot_product_attention(q, k, v, is_causal=True) of the whole sequence, for this rank's slice of it
    in zigzag order (shard_sequence's; shapes as cosine_ring_attention's), on PyTorch's context-parallel SDPA over
    ``mesh`` (softmax_mesh's): a ring that passes K/V blocks from rank to rank and merges each block's output by
    its log-sum-exp, in fp32. ``backend`` is SDPA's (RING_BACKENDS; "auto": PyTorch's pick among them). Every
    rank of the mesh must call it, and run its backward."""
    check_slices(q, k, v, zigzag=True)
    if backend not in RING_BACKENDS:
        raise ValueError(f"backend: PyTorch's ring runs SDPA's fused kernels, expected one of {tuple(RING_BACKENDS)}, "
                         f"got {backend!r}")
    # Grouped heads expanded first: SDPA's cuDNN kernel takes none (enable_gqa is flash's and math's).
    k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    q, k, v = (DTensor.from_local(x, mesh, [Shard(2)], run_check=False) for x in (q, k, v))
    with sdpa_kernel(RING_BACKENDS[backend]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).to_local()
