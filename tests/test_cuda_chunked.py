"""The chunked Hopper linear form (attn_cuda::lin_state + lin_read, csrc/lin_sm90.cuh) against float64, on
chunk-major rows, next to the sweep it replaces on Hopper (attn_cuda::linear) on the same inputs.

Error rule: the chunked ops' largest error (relative to the largest reference value) is at most twice the
sweep's plus 1e-3; end to end, through fastmax_attention, both meet the FA rule (test_cuda_linear.py).
"""
import pytest
import torch

from attention_cuda._kernels import _folded, _image_scale, _state, _summed_image, _whole
from test_cuda_kernels import LINEAR_DTYPES

pytestmark = pytest.mark.gpu


def ops():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from attention_cuda._extension import unavailable_reason
    if unavailable_reason() is not None or not torch.ops.attn_cuda.chunked_head_dims(torch.bfloat16):
        pytest.skip("chunked linear-form kernels not built for this device")
    return torch.ops.attn_cuda


def rows(shape, d, dtype, gen, spread=1.0, keep=1.0):
    x = torch.zeros(*shape, d + 16, device="cuda")
    x[..., :d] = torch.randn(*shape, d, device="cuda", generator=gen) * spread
    x[..., d] = (torch.rand(*shape, device="cuda", generator=gen) < keep).float()
    return x.to(dtype)


def reference(ux, uw, rx, rg, upd, rd, causal, reverse, coef):
    """R1 = sum_s f(x_t, u_s) w_s and R2 = d/dx_t sum_s f(x_t, u_s) (w_s . g_t) over the visible chunks."""
    c0, c1, c2 = coef
    ux, uw, rx, rg = (t.double() for t in (ux, uw, rx, rg))
    B, C, _, L, W = ux.shape
    d = W - 16
    r1, r2 = torch.zeros_like(rx), torch.zeros(*rx.shape[:4], d, dtype=torch.float64, device="cuda")
    for b in range(B):
        for kv in range(ux.shape[2] // upd):
            U = ux[b, :, kv * upd:(kv + 1) * upd].reshape(C, -1, W)
            V = uw[b, :, kv * upd:(kv + 1) * upd].reshape(C, -1, W)
            for c in range(C):
                seen = [j for j in range(C) if not causal or (j > c if reverse else j < c)]
                if not seen:
                    continue
                u, w = U[seen].reshape(-1, W), V[seen].reshape(-1, W)
                x, g = rx[b, c, kv * rd:(kv + 1) * rd], rg[b, c, kv * rd:(kv + 1) * rd]
                dot = x[..., :d] @ u[:, :d].T
                f = c0 * x[..., d:d + 1] * u[:, d] + c1 * dot + c2 * dot ** 2
                r1[b, c, kv * rd:(kv + 1) * rd] = f @ w
                r2[b, c, kv * rd:(kv + 1) * rd] = ((g @ w.T) * (c1 + 2 * c2 * dot)) @ u[:, :d]
    return r1, r2


@pytest.mark.parametrize("heads", [(1, 2), (2, 1)])
@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("order", ["causal", "reverse", "all"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", LINEAR_DTYPES, ids=lambda t: str(t).split(".")[-1])
def test_chunked_matches_float64(dtype, d, order, p, heads):
    o = ops()
    if d not in o.chunked_head_dims(dtype):
        pytest.skip(f"no chunked kernel for {dtype} d{d}")
    upd, rd = heads
    causal, reverse, second = order != "all", order == "reverse", p == 2
    gen = torch.Generator(device="cuda").manual_seed(d + 7 * upd + 31 * p)
    B, C, L, hkv = 2, 3, 128, 2
    ux = rows((B, C, hkv * upd, L), d, dtype, gen, 0.3, keep=0.8)  # some masked rows (constant 0)
    uw = rows((B, C, hkv * upd, L), d, dtype, gen)
    rx = rows((B, C, hkv * rd, L), d, dtype, gen, 0.3)
    rg = rows((B, C, hkv * rd, L), d, dtype, gen, 0.01)
    cu, cr = [1.0, 1.0, 1.0], [0.7, 0.5, 0.125]
    coef = [a * b for a, b in zip(cu, cr)]
    scale = _image_scale(ux, uw, upd, coef)  # the scale linear_attention stores the image at
    image = o.lin_state(ux, uw, upd, causal, reverse, second, coef, scale)
    n1, n2 = o.lin_read(rx, rg, image, rd, second, d + 8, scale)
    s1, s2 = o.linear(ux, uw, rx, rg, upd, rd, causal, reverse, second, cu, cr, (d + 16) // 16, True)
    f1, f2 = reference(ux, uw, rx, rg, upd, rd, causal, reverse, coef if second else coef[:2] + [0.0])

    def err(a, ref, cols):
        return ((a[..., :cols].double() - ref[..., :cols]).abs().max() / ref[..., :cols].abs().max()).item()
    for name, new, sweep, ref, cols in (("R1", n1, s1, f1, d + 1), ("R2", n2, s2, f2, d)):
        assert torch.isfinite(new[..., :cols]).all(), name
        assert err(new, ref, cols) <= 2 * err(sweep, ref, cols) + 1e-3, (name, err(new, ref, cols), err(sweep, ref, cols))


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", LINEAR_DTYPES, ids=lambda t: str(t).split(".")[-1])
def test_images_at_scales_of_their_own_summed_read_as_the_sum_of_their_states(dtype, d):
    """_summed_image on lin_state's images (context parallelism sums the ranks' images this way): an image is its
    state element by element in the rows' dtype, so images of three sets of rows, each at the scale
    linear_attention gives it (fp16: different ones), brought to one scale and added, read as the state of all
    their rows. Same error rule as above, against the sum of the three images' reads."""
    o = ops()
    if d not in o.chunked_head_dims(dtype):
        pytest.skip(f"no chunked kernel for {dtype} d{d}")
    gen = torch.Generator(device="cuda").manual_seed(d + 3)
    B, C, L, hkv, upd, rd = 2, 2, 128, 2, 2, 1
    coef = [0.7, 0.5, 0.125]
    rx = rows((B, C, hkv * rd, L), d, dtype, gen, 0.3)
    rg = rows((B, C, hkv * rd, L), d, dtype, gen, 0.01)
    images, parts, refs = [], [], []
    for spread in (0.3, 1.0, 3.0):  # states of different sizes, so fp16 images at scales of their own
        ux, uw = rows((B, C, hkv * upd, L), d, dtype, gen, spread), rows((B, C, hkv * upd, L), d, dtype, gen)
        scale = _image_scale(ux, uw, upd, coef)
        images.append((o.lin_state(ux, uw, upd, False, False, True, coef, scale), scale))
        parts.append(o.lin_read(rx, rg, images[-1][0], rd, True, d + 8, scale))
        refs.append(reference(ux, uw, rx, rg, upd, rd, False, False, coef))
    if dtype == torch.float16:
        assert len({scale.item() for _, scale in images}) == 3
    image, scale = _summed_image(images, dtype)
    summed = o.lin_read(rx, rg, image, rd, True, d + 8, scale)

    def err(a, ref, cols):
        return ((a[..., :cols].double() - ref[..., :cols]).abs().max() / ref[..., :cols].abs().max()).item()
    for i, (name, cols) in enumerate((("R1", d + 1), ("R2", d))):
        ref, each = sum(r[i] for r in refs), sum(part[i].double() for part in parts)
        assert torch.isfinite(summed[i][..., :cols]).all(), name
        assert err(summed[i], ref, cols) <= 2 * err(each, ref, cols) + 1e-3, (name, err(summed[i], ref, cols),
                                                                            err(each, ref, cols))


@pytest.mark.parametrize("reverse", [False, True], ids=["causal", "reverse"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", LINEAR_DTYPES, ids=lambda t: str(t).split(".")[-1])
def test_a_state_folded_into_a_causal_one_and_its_whole_read_as_their_rows(dtype, d, reverse):
    """Context parallelism's two uses of lin_state's per-chunk images (_LinearAttention with an exchange): another
    set of rows' state (one image, at a scale of its own) folded into every chunk's image of a causal state (in
    place, _folded) reads, chunk by chunk, as the causal state plus the other rows'; and _whole, the last chunk's
    image (the first's, in reverse) plus a lin_state over that chunk alone, reads as the state over all the rows.
    Same error rule as above: against the separate reads, and against a lin_state over all the rows."""
    o = ops()
    if d not in o.chunked_head_dims(dtype):
        pytest.skip(f"no chunked kernel for {dtype} d{d}")
    gen = torch.Generator(device="cuda").manual_seed(d + 5 + reverse)
    B, C, L, hkv, upd, rd = 2, 3, 128, 2, 2, 1
    coef = [0.7, 0.5, 0.125]
    rx = rows((B, C, hkv * rd, L), d, dtype, gen, 0.3)
    rg = rows((B, C, hkv * rd, L), d, dtype, gen, 0.01)
    ux, uw = rows((B, C, hkv * upd, L), d, dtype, gen, 0.3), rows((B, C, hkv * upd, L), d, dtype, gen)
    ox, ow = rows((B, C, hkv * upd, L), d, dtype, gen, 3.0), rows((B, C, hkv * upd, L), d, dtype, gen)
    local = _state(ux, uw, upd, True, reverse, True, coef)
    other = _state(ox, ow, upd, False, False, True, coef)
    if dtype == torch.float16:
        assert local[1].item() != other[1].item()
    whole = _whole(local, ux, uw, upd, reverse, True, coef)
    all_rows = _state(ux, uw, upd, False, False, True, coef)
    each = [o.lin_read(rx, rg, image, rd, True, d + 8, scale) for image, scale in (local, other)]
    folded = _folded(local, other, dtype)
    assert folded[0] is local[0], "in place"

    def err(a, ref, cols):
        return ((a[..., :cols].double() - ref[..., :cols]).abs().max() / ref[..., :cols].abs().max()).item()
    refs = [reference(ux, uw, rx, rg, upd, rd, True, reverse, coef),
            reference(ox, ow, rx, rg, upd, rd, False, False, coef)]
    whole_ref = reference(ux, uw, rx, rg, upd, rd, False, False, coef)
    checks = [("folded", folded, [sum(r[i] for r in refs) for i in range(2)],
               [sum(part[i].double() for part in each) for i in range(2)]),
              ("whole", whole, whole_ref, o.lin_read(rx, rg, all_rows[0], rd, True, d + 8, all_rows[1]))]
    for what, (image, scale), ref, baseline in checks:
        got = o.lin_read(rx, rg, image, rd, True, d + 8, scale)
        for i, (name, cols) in enumerate((("R1", d + 1), ("R2", d))):
            assert torch.isfinite(got[i][..., :cols]).all(), (what, name)
            assert err(got[i], ref[i], cols) <= 2 * err(baseline[i], ref[i], cols) + 1e-3, (
                what, name, err(got[i], ref[i], cols), err(baseline[i], ref[i], cols))


def test_chunks_of_other_than_whole_128_rows_are_refused():
    """Both ops work in 128-row blocks (lin_state's stages at d64, lin_read's CTAs): other chunk lengths
    get an error naming the requirement, not a failed launch."""
    o = ops()
    gen = torch.Generator(device="cuda").manual_seed(5)
    x = rows((1, 2, 1, 64), 64, torch.bfloat16, gen)
    scale = torch.ones(1, device="cuda")
    with pytest.raises(RuntimeError, match="multiple of 128"):
        o.lin_state(x, x, 1, True, False, True, [1.0, 1.0, 0.5], scale)
