"""The linear-form fastmax's custom backward: exact gradients, and O(N D) memory saved for backward."""
import pytest
import torch

from attention_cuda import reference
from attention_cuda.score import fastmax_policy

F64 = torch.float64


def policy(p=2, normalize=False):
    return fastmax_policy(p, 1.0, 1.0, 0.5, 1.5, normalize, 1.3 if p == 2 else 1.0)


def inputs(b, h, hkv, i, j, d, dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, i, d, generator=g, dtype=F64)
    k, v = (torch.randn(b, hkv, j, d, generator=g, dtype=F64) for _ in range(2))
    return [x.to(dtype).requires_grad_() for x in (q, k, v)]


def grads(out, inputs, seed=1):
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=F64).to(out.dtype)
    return torch.autograd.grad(out, inputs, g)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("i,j", [(1, 1), (37, 37), (11, 30), (30, 11), (20, 45)])
@pytest.mark.parametrize("hkv", [4, 2, 1])
@pytest.mark.parametrize("p,normalize", [(2, False), (2, True), (1, True)])
def test_gradients_equal_quadratic_form(causal, masked, i, j, hkv, p, normalize):
    q, k, v = inputs(2, 4, hkv, i, j, 8, seed=i * 100 + j)
    mask = torch.rand(2, j, generator=torch.Generator().manual_seed(j)) > 0.3 if masked else None
    pol = policy(p, normalize)
    lin = reference.fastmax_linear(q, k, v, mask, causal, pol, chunk=8)  # many chunks, ragged last one
    quad = reference.quadratic(q, k, v, mask, None, causal, pol)
    torch.testing.assert_close(lin, quad, rtol=1e-10, atol=1e-10)
    for a, b in zip(grads(lin, (q, k, v)), grads(quad, (q, k, v))):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_gradients_do_not_depend_on_chunk(chunk):
    q, k, v = inputs(1, 2, 1, 13, 17, 4)
    mask = torch.arange(17) % 5 != 0
    args = (mask[None], True, policy(2, True))
    ref = grads(reference.quadratic(q, k, v, args[0], None, *args[1:]), (q, k, v))
    for a, b in zip(grads(reference.fastmax_linear(q, k, v, *args, chunk=chunk), (q, k, v)), ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck(causal):
    q, k, v = inputs(1, 2, 1, 5, 7, 3)
    mask = torch.tensor([[True, False, True, True, True, False, True]])
    pol = policy(2, True)
    assert torch.autograd.gradcheck(lambda q, k, v: reference.fastmax_linear(q, k, v, mask, causal, pol, chunk=2),
                                    (q, k, v))


def test_rows_without_visible_keys_get_zero_gradient():
    q, k, v = inputs(2, 2, 2, 9, 4, 8)
    mask = torch.ones(2, 4, dtype=torch.bool)
    mask[1] = False  # batch 1 sees nothing; causal with i > j: queries 0..4 of batch 0 see nothing
    out = reference.fastmax_linear(q, k, v, mask, True, policy(), chunk=2)
    dq, dk, dv = grads(out, (q, k, v))
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.equal(out[0, :, :5], torch.zeros(2, 5, 8, dtype=F64))
    assert torch.equal(dq[1], torch.zeros_like(dq[1])) and torch.equal(dq[0, :, :5], torch.zeros(2, 5, 8, dtype=F64))
    assert torch.equal(dk[1], torch.zeros_like(dk[1])) and torch.equal(dv[1], torch.zeros_like(dv[1]))
    assert dq[0, :, 5:].abs().sum() > 0 and dk[0].abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_inputs_keep_their_dtype_and_stay_close(dtype):
    x64 = inputs(1, 4, 2, 150, 150, 16)
    x = [t.detach().to(dtype).requires_grad_() for t in x64]
    pol = policy(2, True)
    out = reference.fastmax_linear(*x, None, True, pol, chunk=32)
    ref = reference.quadratic(*x64, None, None, True, pol)
    assert out.dtype == dtype
    for a, b in zip((out, *grads(out, x)), (ref, *grads(ref, x64))):
        assert a.dtype == dtype
        err = ((a.double() - b).norm() / b.norm()).item()
        assert err < (1e-5 if dtype == torch.float32 else 2e-2), err


def saved_bytes(n, d=16):
    """Bytes of the storages autograd keeps for the backward of one call (counted once each)."""
    q, k, v = inputs(1, 2, 2, n, n, d, dtype=torch.float32)
    mask = torch.arange(n)[None] % 7 != 3
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = reference.fastmax_linear(q, k, v, mask, True, policy(), chunk=64)
    qkv = sum(t.numel() * t.element_size() for t in (q, k, v))
    return sum(storages.values()), qkv, out


def test_saved_memory_is_linear_in_sequence_length():
    small, _, _ = saved_bytes(256)
    mid, _, _ = saved_bytes(512)
    big, qkv, _ = saved_bytes(1024)
    # q, k, v, mask, output and l: everything scales with N. Per-chunk feature maps (N x 153 floats
    # at D=16) or moments (153 x 17 per chunk) would put this far above.
    assert big < 2 * qkv, (big, qkv)
    assert big <= 2.01 * mid and mid <= 2.01 * small, (small, mid, big)


def test_bad_chunk_is_rejected():
    q, k, v = inputs(1, 1, 1, 4, 4, 8)
    with pytest.raises(ValueError, match="chunk"):
        reference.fastmax_linear(q, k, v, None, True, policy(), chunk=0)
