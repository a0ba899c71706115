"""The linear form's glue around the chunked kernels (attention_cuda._kernels._LinearAttention: rows in and out,
moments, the diagonal blocks, g and its scale, the values' mean) on the kernels' stand-ins (kernel_standins: each
op's contract in float64 PyTorch), on a CPU, against the float64 reference. The kernels themselves are
tests/test_cuda_linear.py's (GPU); the same glue across the ranks of a context group, test_context_parallel.py's."""
import functools

import pytest
import torch

import kernel_standins
from attention_cuda import _kernels, fastmax_attention
from attention_cuda.score import fastmax_policy

DEFAULTS = dict(p=2, a0=1.0, a1=1.0, a2=0.5, temperature=1.0, normalize=False, lim=1.0)  # fastmax_attention's


@pytest.fixture
def standins(monkeypatch):
    kernel_standins.install(functools.partial(monkeypatch.setattr, raising=False))


def output_and_grads(attention, inputs, d_out):
    leaves = [x.detach().requires_grad_() for x in inputs]
    out = attention(*leaves)
    return (out.detach(), *torch.autograd.grad(out, leaves, d_out))


@pytest.mark.parametrize("causal, masked, shape, options", [
    (True, False, (2, 4, 2, 40, 40), {}),
    (False, False, (2, 4, 4, 40, 40), {}),
    (True, True, (2, 4, 2, 30, 50), {}),  # more keys than queries, and a mask
    (True, True, (1, 2, 1, 50, 30), {}),  # fewer: the first queries see placeholder keys
    (True, True, (2, 4, 2, 40, 40), dict(normalize=True, lim=1.5, a0=2.0, a1=0.5, a2=0.25)),
    (True, False, (2, 4, 2, 40, 40), dict(p=1, normalize=True, lim=1.0)),
])
def test_the_linear_form_s_glue_gives_the_reference_s_outputs_and_gradients(causal, masked, shape, options, standins):
    b, h, hkv, i, j = shape
    gen = torch.Generator().manual_seed(0)
    q, d_out = (torch.randn(b, h, i, 8, dtype=torch.float64, generator=gen) for _ in range(2))
    k, v = (torch.randn(b, hkv, j, 8, dtype=torch.float64, generator=gen) for _ in range(2))
    mask = torch.rand(b, j, generator=gen) > 0.3 if masked else None
    options = dict(temperature=2.0, **options)
    expected = output_and_grads(functools.partial(fastmax_attention, causal=causal, mask=mask, backend="torch",
                                                  form="quadratic", **options), (q, k, v + 3), d_out)
    policy = fastmax_policy(**{**DEFAULTS, **options})
    # fp32: the glue takes a float32 gradient norm of q, which fp64 rows would not narrow to.
    linear = functools.partial(_kernels.linear_attention, mask=mask, causal=causal, policy=policy,
                               dtype=torch.float32, chunk=16, chunked=True)
    got = output_and_grads(linear, [x.float() for x in (q, k, v + 3)], d_out.float())
    for name, g, e in zip(("out", "dq", "dk", "dv"), got, expected):
        torch.testing.assert_close(g.double(), e, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_an_exchange_needs_the_chunked_kernels():
    q = torch.zeros(1, 2, 8, 8)
    with pytest.raises(ValueError, match="exchange: .* expected chunked=True"):
        _kernels.linear_attention(q, q, q, None, True, fastmax_policy(**DEFAULTS), torch.bfloat16, 128, False,
                                  exchange=object())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=lambda t: str(t).split(".")[-1])
@pytest.mark.parametrize("chunks", [1, 3], ids=["summed", "folded"])
def test_images_at_scales_of_their_own_sum_to_one_image_of_the_sum_of_their_states(dtype, chunks):
    """_summed_image on images as the kernels hold them (bytes of dtype's elements, each state at a power-of-two
    scale of its own): the sum, written over the first image's bytes, reads as the sum of the states, rounded
    once, and under fp16's bound even where every image is at its bound with one sign. Folded (chunks=3: the first
    holds a causal state's image per chunk, the others one image each), every chunk's image reads as its own state
    plus the others'. One image comes back as it was; a zero image at an infinite scale (a rank whose gradient is
    zero) adds nothing, and alone reads as zeros."""
    gen = torch.Generator().manual_seed(0)
    bound = _kernels._image_max(dtype)
    scales = [2.0 ** -3, 1.0, 2.0 ** 5, 1.0]
    shapes = [(1, 2, chunks, 48)] + [(1, 2, 1, 48)] * 3
    elements = [(torch.rand(*shape, generator=gen, dtype=torch.float64) * 2 - 1) * 2.0 ** 14 for shape in shapes]
    for e in elements:
        e[..., 0] = 2.0 ** 14  # the largest an image holds (at its bound, for fp16), all of one sign

    def images():
        return [(e.to(dtype).view(torch.uint8), torch.tensor([s])) for e, s in zip(elements, scales)]

    def state(image, scale):
        return image.view(dtype).double() / scale.double()

    pairs = images()
    expected = sum(state(*pair) for pair in pairs)  # (1, 2, chunks, 48): the others add to every chunk's
    first = pairs[0][0]
    summed, common = _kernels._summed_image(pairs, dtype)
    assert summed is first, "written over the first image's bytes"
    assert torch.isfinite(summed.view(dtype)).all()
    if bound is not None:
        assert summed.view(dtype).abs().max() <= bound
    eps = torch.finfo(dtype).eps  # one rounding of the sum (half an ulp), and the images' own are in expected
    torch.testing.assert_close(state(summed, common), expected, rtol=0, atol=eps * expected.abs().max().item())

    pairs = images()
    alone, alone_scale = _kernels._summed_image(pairs[2:3], dtype)
    assert alone is pairs[2][0] and alone_scale is pairs[2][1]

    zero = (torch.zeros(1, 2, 1, 48, dtype=dtype).view(torch.uint8), torch.tensor([float("inf")]))
    with_zero = _kernels._folded(pairs[0], zero, dtype)
    torch.testing.assert_close(state(*with_zero), state(*images()[0]), rtol=0, atol=0)
    zeros = torch.zeros(1, 2, 1, 48, dtype=torch.float64)
    assert torch.equal(state(*_kernels._summed_image([zero], dtype)), zeros)
    both = _kernels._summed_image([zero, (zero[0].clone(), zero[1])], dtype)
    assert torch.isfinite(both[1]).all() and torch.equal(state(*both), zeros)
    assert _kernels._summed_image([], dtype) is None
    assert _kernels._folded(pairs[1], None, dtype) is pairs[1]
