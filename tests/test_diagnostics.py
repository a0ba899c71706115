"""model.diagnostics: the weights it recomputes are the ones the model's attention uses, and its statistics
are those of the weights."""
import dataclasses
import math

import pytest
import torch

from attention_cuda import attention_weights, reference
from attention_cuda.score import fastmax_policy
from model import GPT, GPTConfig
from model import diagnostics
from model.diagnostics import attention_concentration, capture_qkv, layer_policy, softmax_policy, summarize

FAMILIES = {
    "softmax": {"attention": "softmax"},
    "cosine": {"attention": "cosine"},
    "cosine_sdpa": {"attention": "cosine", "cosine_sdpa": True},
    "fastmax": {"attention": "fastmax"},
    "fastmax_p1_normalize": {"attention": "fastmax", "fastmax_p": 1, "fastmax_normalize": True, "fastmax_lim": 2.0},
    "softmax_gqa": {"attention": "softmax", "n_head": 4, "n_kv_head": 2},
    "fastmax_gqa": {"attention": "fastmax", "n_head": 4, "n_kv_head": 2},
    "cosine_mqa": {"attention": "cosine", "n_head": 4, "n_kv_head": 1},
}


def tiny_model(**overrides) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{"n_layer": 2, "n_head": 2, "n_embd": 32, "seq_len": 64, **overrides}))
    # Larger q and k than at init, so that the weights are far from uniform and a wrong scale shows.
    with torch.no_grad():
        for block in model.blocks:
            block.attn.qkv.weight.mul_(8.0)
    return model


def proj_inputs(model: GPT, x: torch.Tensor) -> list[torch.Tensor]:
    """Each block's attention output before the output projection, (B, T, H D), from one forward."""
    out = []
    handles = [block.attn.proj.register_forward_hook(lambda m, inputs, output: out.append(inputs[0]))
               for block in model.blocks]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()
    return out


def recomputed(model: GPT, x: torch.Tensor, n: int, window_of=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (weights (B, H, n, T), weights @ v (B, n, H D)) of the last n queries, from capture_qkv."""
    cfg, out = model.cfg, []
    t = x.shape[1]
    for layer, (q, k, v) in enumerate(capture_qkv(model, x)):
        policy, window = layer_policy(cfg, layer)
        w = attention_weights(q[:, :, t - n:], reference.expand_kv(k, cfg.n_head), policy, start=t - n, window=window)
        y = w @ reference.expand_kv(v, cfg.n_head).float()
        out.append((w, y.transpose(1, 2).reshape(x.shape[0], n, -1)))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_weights_reproduce_the_attention_output(family):
    """weights @ v of the captured q, k, v is the block's attention output: the weights are the model's."""
    model = tiny_model(**FAMILIES[family]).eval()
    x = torch.randint(0, 256, (2, 48))
    n = 20
    actual = proj_inputs(model, x)
    for layer, (w, y) in enumerate(recomputed(model, x, n)):
        torch.testing.assert_close(y, actual[layer][:, -n:].float(), rtol=1e-4, atol=1e-5, msg=f"layer {layer}")
        # far enough from uniform (whose largest weight is 1 / keys) that the comparison can tell a wrong scale
        assert (w.amax(-1) * torch.arange(x.shape[1] - n + 1, x.shape[1] + 1)).amax() > 1.5


@pytest.mark.parametrize("family", ["softmax", "cosine", "fastmax"])
def test_a_wrong_policy_does_not_reproduce_it(family):
    """The reproduction test can fail: the weights of another family (or another scale) miss the output."""
    model = tiny_model(**FAMILIES[family]).eval()
    x = torch.randint(0, 256, (1, 48))
    wrong = {"softmax": dict(attention="cosine"), "cosine": dict(cosine_scale=5.0),
             "fastmax": dict(fastmax_temperature=2.0)}[family]
    model.cfg = dataclasses.replace(model.cfg, **wrong)  # the weights math reads the config; the model does not
    actual = proj_inputs(model, x)
    _, y = recomputed(model, x, 16)[0]
    assert not torch.allclose(y, actual[0][:, -16:].float(), rtol=1e-3, atol=1e-4)


def test_weights_match_the_reference_quadratic():
    """weights @ v equals attention_cuda.reference.quadratic's output, policy by policy, with grouped heads."""
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 4, 12, 8) * 3, torch.randn(2, 2, 12, 8) * 3, torch.randn(2, 2, 12, 8)
    for policy in (softmax_policy(8), layer_policy(GPTConfig(attention="cosine", n_embd=32, n_head=4), 0)[0],
                   fastmax_policy(2, 1.0, 1.0, 0.5, 2.0, False, 1.0), fastmax_policy(1, 1.0, 0.1, 0.0, 1.0, True, 3.0)):
        want = reference.quadratic(q[:, :, -5:], k, v, None, None, True, policy)
        w = attention_weights(q[:, :, -5:], reference.expand_kv(k, 4), policy, start=7)
        torch.testing.assert_close(w @ reference.expand_kv(v, 4), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("window", [0, 1, 3, 20])
def test_weights_sum_to_one_and_stay_causal(window):
    torch.manual_seed(2)
    q, k = torch.randn(3, 10, 16) * 2, torch.randn(3, 10, 16) * 2
    for policy in (softmax_policy(16), fastmax_policy(2, 1.0, 1.0, 0.5, 4.0, False, 1.0)):
        w = attention_weights(q, k, policy, start=0, window=window)
        torch.testing.assert_close(w.sum(-1), torch.ones(3, 10))
        t, s = torch.arange(10)[:, None], torch.arange(10)[None, :]
        hidden = (s > t) | ((s <= t - window) if window else torch.zeros(10, 10, dtype=torch.bool))
        assert (w[:, hidden] == 0).all() and (w[:, ~hidden] > 0).all()


def test_windowed_softmax():
    """With a window, softmax over the logits of keys t - window + 1 .. t only; key_start shifts positions."""
    torch.manual_seed(3)
    q, k = torch.randn(2, 6, 8), torch.randn(2, 30, 8)
    start, window = 24, 4
    w = attention_weights(q, k, softmax_policy(8), start=start, window=window)
    for i in range(6):
        t = start + i
        want = torch.softmax((q[:, i, None] @ k[:, t - window + 1:t + 1].mT)[:, 0] / math.sqrt(8), dim=-1)
        torch.testing.assert_close(w[:, i, t - window + 1:t + 1], want)
    # the same rows from keys 21 .. 29 only, as the chunked statistics pass them
    torch.testing.assert_close(attention_weights(q, k[:, 21:], softmax_policy(8), start=start, key_start=21,
                                                 window=window), w[:, :, 21:])


@pytest.mark.parametrize("family", ["softmax", "cosine", "fastmax"])
def test_uniform_weights(family):
    """Zero q and k: uniform weights over the t + 1 visible keys, entropy log(t + 1), largest weight 1/(t + 1)."""
    model = tiny_model(**FAMILIES[family])
    with torch.no_grad():
        for block in model.blocks:
            block.attn.qkv.weight.zero_()
    x = torch.randint(0, 256, (2, 40))
    stats = attention_concentration(model, x, queries=10)
    seen = torch.arange(31, 41, dtype=torch.float64)  # positions 30 .. 39
    assert stats["queries"] == 10
    assert stats["keys"] == pytest.approx([seen.mean().item()] * 2)
    assert stats["log_keys"] == pytest.approx([seen.log().mean().item()] * 2)
    for layer in range(2):
        assert stats["max_weight"][layer] == pytest.approx([(1 / seen).mean().item()] * 2, rel=1e-5)
        assert stats["entropy"][layer] == pytest.approx([seen.log().mean().item()] * 2, rel=1e-5)
    one = attention_concentration(model, x, queries=1)
    assert one["max_weight"][0][0] == pytest.approx(1 / 40, rel=1e-5)
    assert one["entropy"][0][0] == pytest.approx(math.log(40), rel=1e-5)
    flat = summarize(stats)
    assert flat["attn/entropy"] == pytest.approx(flat["attn/entropy_uniform"], rel=1e-5)


def direct_stats(model: GPT, x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(max_weight, entropy) as (layers, heads), from the whole weights of the last n queries at once."""
    weights = [w for w, _ in recomputed(model, x, n)]
    top = torch.stack([w.amax(-1).mean(dim=(0, 2)) for w in weights])
    entropy = torch.stack([-torch.xlogy(w, w).sum(-1).mean(dim=(0, 2)) for w in weights])
    return top, entropy


@pytest.mark.parametrize("family", ["softmax", "fastmax_gqa"])
@pytest.mark.parametrize("chunk_bytes", [diagnostics.CHUNK_BYTES, 16 * 64 * 7, 16 * 64 * 40])
def test_statistics_of_the_weights(family, chunk_bytes, monkeypatch):
    """max_weight and entropy are the means of each row's largest weight and entropy, however it chunks (one
    head in parts of 7, 7 and 6 queries, or 2 heads x all queries, at these budgets)."""
    monkeypatch.setattr(diagnostics, "CHUNK_BYTES", chunk_bytes)
    model = tiny_model(**FAMILIES[family]).train()
    x = torch.randint(0, 256, (2, 64))
    stats = attention_concentration(model, x, queries=20)
    assert model.training  # restored
    top, entropy = direct_stats(model.eval(), x, 20)
    torch.testing.assert_close(torch.tensor(stats["max_weight"]), top, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(stats["entropy"]), entropy, rtol=1e-5, atol=1e-6)
    assert 0 < min(min(layer) for layer in stats["max_weight"]) and max(max(layer) for layer in stats["max_weight"]) <= 1
    assert stats["queries"] == 20 and stats["keys"] == pytest.approx([(45 + 64) / 2] * 2)


def test_short_sequences_take_every_position():
    model = tiny_model()
    stats = attention_concentration(model, torch.randint(0, 256, (1, 5)))
    assert stats["queries"] == 5 and stats["keys"] == pytest.approx([3.0, 3.0])
    assert all(e >= 0 for layer in stats["entropy"] for e in layer)


@pytest.mark.parametrize("family", ["softmax", "fastmax"])
def test_sliding_window_layers(family, monkeypatch):
    """With cfg.swa_window set, odd layers' weights are softmax over the window (whatever the family), even
    layers keep the family's; keys and log_keys count the window."""
    model = tiny_model(**FAMILIES[family])
    x = torch.randint(0, 256, (2, 48))
    before = attention_concentration(model, x, queries=16)
    monkeypatch.setattr(model.cfg, "swa_window", 8)  # the weights math reads the config; the model does not
    assert layer_policy(model.cfg, 1) == (softmax_policy(16), 8)
    assert layer_policy(model.cfg, 0)[1] == 0
    stats = attention_concentration(model, x, queries=16)
    assert stats["keys"] == pytest.approx([(33 + 48) / 2, 8.0])
    assert stats["log_keys"][1] == pytest.approx(math.log(8))
    assert stats["max_weight"][0] == pytest.approx(before["max_weight"][0], rel=1e-6)
    (q, k, _) = capture_qkv(model, x)[1]
    w = attention_weights(q[:, :, -16:], k, softmax_policy(16), start=32, window=8)
    assert (w[..., :32 - 8 + 1] == 0).all()
    assert stats["max_weight"][1] == pytest.approx(w.amax(-1).mean(dim=(0, 2)).tolist(), rel=1e-5)
    assert stats["entropy"][1] == pytest.approx((-torch.xlogy(w, w).sum(-1)).mean(dim=(0, 2)).tolist(), rel=1e-5)
    assert max(stats["entropy"][1]) <= math.log(8) + 1e-6


@pytest.mark.parametrize("family", ["softmax", "fastmax"])
def test_sliding_window_model_reproduced(family):
    """Once the model runs sliding windows itself, the windowed weights reproduce its odd layers' outputs."""
    model = tiny_model(**FAMILIES[family], swa_window=8).eval()
    x = torch.randint(0, 256, (2, 48))
    actual = proj_inputs(model, x)
    for layer, (_, y) in enumerate(recomputed(model, x, 20)):
        torch.testing.assert_close(y, actual[layer][:, -20:].float(), rtol=1e-4, atol=1e-5, msg=f"layer {layer}")


def test_summarize():
    stats = {"max_weight": [[0.5, 0.1], [0.2, 0.8]], "entropy": [[1.0, 3.0], [2.0, 0.5]], "keys": [10.0, 4.0],
             "log_keys": [2.0, 1.0], "queries": 3}
    assert summarize(stats) == pytest.approx({"attn/max_weight": 0.4, "attn/max_weight_max": 0.8,
                                              "attn/entropy": 1.625, "attn/entropy_min": 0.5,
                                              "attn/entropy_uniform": 1.5})


def test_bad_arguments():
    model = tiny_model()
    with pytest.raises(ValueError, match="queries"):
        attention_concentration(model, torch.zeros(1, 8, dtype=torch.long), queries=0)
    with pytest.raises(ValueError, match="x: expected"):
        attention_concentration(model, torch.zeros(8, dtype=torch.long))
