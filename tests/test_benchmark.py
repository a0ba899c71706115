"""benchmark.py on the CPU: FLOP arithmetic, flags, output tables and JSON, and that every baseline
computes the function it claims to (a fast wrong baseline would make every ratio a lie)."""
import json
import math
import subprocess
from pathlib import Path

import pytest
import torch

import benchmark


pytestmark = pytest.mark.usefixtures("one_thread")


TINY = ["--device", "cpu", "--batch", "1", "--heads", "2", "--dim-head", "8",
        "--repeats", "2", "--warmup", "1"]


def test_attention_flops_against_hand_counts():
    # b=2 h=3 n=128 d=64: 4 * 2 * 3 * 128 * 128 * 64 = 25,165,824
    assert benchmark.attention_flops(2, 3, 128, 128, 64, False, "fwd") == 25_165_824
    assert benchmark.attention_flops(2, 3, 128, 128, 64, True, "fwd") == 12_582_912
    assert benchmark.attention_flops(2, 3, 128, 128, 64, False, "bwd") == 62_914_560
    assert benchmark.attention_flops(2, 3, 128, 128, 64, True, "bwd") == 31_457_280
    assert benchmark.attention_flops(2, 3, 128, 128, 64, False, "fwd+bwd") == 88_080_384
    # cross-attention shape i=100, j=300, b=h=1, d=16: 4 * 100 * 300 * 16
    assert benchmark.attention_flops(1, 1, 100, 300, 16, False, "fwd") == 1_920_000
    # 1e12 FLOPs in 1000 ms is 1 TFLOP/s
    assert benchmark.tflops(1e12, 1000.0) == pytest.approx(1.0)


def test_cpu_run_prints_tables_and_writes_json(tmp_path, capsys):
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    argv = [*TINY, "--kv-heads", "1", "--seq-lens", "16,32", "--causal", "--mask-prob", "0.25",
            "--impls", "ours-torch,naive,math", "--json", str(out_json), "--plot", str(out_png)]
    rows = benchmark.main(argv)
    printed = capsys.readouterr().out
    assert "not performance claims" in printed
    assert "seq_len | slower: x | kernel ms | baseline ms | kernel TFLOP/s" in printed
    assert "cosine fwd+bwd b=1 h=2 kv=1 d=8 bf16 causal mask_prob=0.25" in printed
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    saved = json.loads(out_json.read_text())
    assert saved["measurements"] == rows
    assert saved["environment"]["command"] == "python benchmark.py " + " ".join(argv)
    assert {"torch", "cuda", "device", "python", "git"} <= saved["environment"].keys()
    assert len(rows) == 2 * 3 * 3  # seq lens x passes x impls
    for r in rows:
        assert {"impl", "family", "pass", "batch", "heads", "kv_heads", "seq_len", "dim_head", "dtype",
                "causal", "mask_prob", "ms", "tflops", "mem_gib", "baseline", "vs_baseline",
                "not_run"} <= r.keys()
        if r["impl"] in ("naive", "math"):
            assert r["not_run"] is None and r["ms"] > 0 and r["mem_gib"] is None  # no memory counter on CPU
            flops = benchmark.attention_flops(1, 2, r["seq_len"], r["seq_len"], 8, True, r["pass"])
            assert r["tflops"] == pytest.approx(flops / (r["ms"] * 1e9))
            assert r["ms_q1"] <= r["ms"] <= r["ms_q3"]
            assert r["baseline"] == "math"
            base = next(b for b in rows if b["impl"] == "math" and b["pass"] == r["pass"]
                        and b["seq_len"] == r["seq_len"])
            assert r["vs_baseline"] == pytest.approx(r["ms"] / base["ms"])
    assert {r["pass"] for r in rows} == {"fwd", "bwd", "fwd+bwd"}


@pytest.mark.parametrize("family", ["exp", "fastmax"])
def test_other_families_run_forward_only(family, capsys):
    impls = "naive,math" + (",fla-parallel,fla-chunk" if family == "fastmax" else "")
    rows = benchmark.main([*TINY, "--family", family, "--seq-lens", "16", "--causal", "--only-forwards",
                           "--impls", impls])
    assert {r["pass"] for r in rows} == {"fwd"}
    by_impl = {r["impl"]: r for r in rows}
    assert by_impl["naive"]["ms"] > 0
    if family == "fastmax":  # fla's kernels are Triton on CUDA: on the CPU they are reported, not timed
        assert by_impl["fla-parallel"]["ms"] is None and by_impl["fla-parallel"]["not_run"]
        assert "not run: fla" in capsys.readouterr().out


def test_fa3_is_reported_not_timed_off_cuda(capsys):
    rows = benchmark.main([*TINY, "--seq-lens", "16", "--only-forwards", "--impls", "naive,fa3"])
    fa3 = next(r for r in rows if r["impl"] == "fa3")
    assert fa3["ms"] is None and "CUDA" in fa3["not_run"]
    assert "not run: FlashAttention-3" in capsys.readouterr().out


def test_fa3_build_script_names_what_it_lacks(tmp_path):
    script = Path(benchmark.__file__).parent / "bench" / "fa3_build.sh"
    usage = subprocess.run(["bash", str(script)], capture_output=True, text=True)
    assert usage.returncode == 2 and "usage: bash bench/fa3_build.sh" in usage.stderr
    missing = subprocess.run(["bash", str(script), str(tmp_path), str(tmp_path), str(tmp_path / "out")],
                             capture_output=True, text=True)
    assert missing.returncode == 2 and "FLASH_ATTENTION_DIR: no hopper/ directory" in missing.stderr
    assert not (tmp_path / "out").exists()


def test_only_backwards_times_the_backward_alone():
    rows = benchmark.main([*TINY, "--seq-lens", "16", "--only-backwards", "--impls", "naive"])
    assert [r["pass"] for r in rows] == ["bwd"] and rows[0]["ms"] > 0


def test_a_failing_implementation_becomes_a_row_and_the_sweep_goes_on(monkeypatch, capsys):
    def out_of_memory(case, keep):
        def fn(q, k, v):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")
        return fn

    monkeypatch.setitem(benchmark.BUILDERS, "flash", out_of_memory)
    monkeypatch.setitem(benchmark.BUILDERS, "efficient", lambda case, keep: lambda q, k, v: q / 0.0)
    rows = benchmark.main([*TINY, "--seq-lens", "16", "--only-forwards", "--impls", "flash,efficient,naive"])
    by_impl = {r["impl"]: r for r in rows}
    assert by_impl["flash"]["not_run"].startswith("OutOfMemoryError: CUDA out of memory")
    assert by_impl["flash"]["ms"] is None and by_impl["flash"]["tflops"] is None
    assert by_impl["efficient"]["not_run"] == "produced NaN or inf on random inputs"
    assert by_impl["naive"]["ms"] > 0 and by_impl["naive"]["vs_baseline"] is None  # no SDPA baseline ran
    assert "not run: OutOfMemoryError" in capsys.readouterr().out


def brute_force(family, q, k, v, keep, causal):
    """Per (query, key) weights written out, independent of the benchmark's helpers."""
    b, h, n, d = q.shape
    k = k[:, [i * k.shape[1] // h for i in range(h)]]  # query head i reads KV head i // (h / h_kv)
    v = v[:, [i * v.shape[1] // h for i in range(h)]]
    if family == "cosine":
        x = benchmark.COSINE_SCALE * torch.einsum("bhtd,bhsd->bhts", q / q.norm(dim=-1, keepdim=True),
                                                  k / k.norm(dim=-1, keepdim=True))
        a = torch.exp(x - x.amax(dim=-1, keepdim=True))
    elif family == "exp":
        a = torch.exp(benchmark.EXP_SCALE * torch.einsum("bhtd,bhsd->bhts", q, k))
    else:
        x = torch.einsum("bhtd,bhsd->bhts", q, k) / math.sqrt(d)
        a = 1 + x + x**2 / 2
    seen = torch.ones(b, 1, n, n, dtype=torch.bool)
    for t in range(n):
        for s in range(n):
            seen[:, 0, t, s] = keep[:, s] & (s <= t or not causal)
    a = a * seen
    out = torch.einsum("bhts,bhsd->bhtd", a, v)
    return out if family == "exp" else out / a.sum(dim=-1, keepdim=True)


@pytest.mark.parametrize("family", ["cosine", "exp", "fastmax"])
@pytest.mark.parametrize("causal", [False, True])
def test_baselines_compute_the_claimed_function(family, causal):
    case = benchmark.Case(family, batch=2, heads=4, kv_heads=2, seq_len=12, dim_head=8, dtype="fp32",
                          causal=causal, mask_prob=0.3, device="cpu")
    gen = torch.Generator().manual_seed(1)
    (q, k, v), _ = benchmark.make_inputs(case, 1, gen)[0][0]
    keep = torch.rand(2, 12, generator=gen) > 0.3
    keep[:, 0] = True
    q, k, v = (t.detach().double() for t in (q, k, v))
    want = brute_force(family, q, k, v, keep, causal)
    impls = ["naive", "ours-torch"] + (["math", "flash"] if family == "cosine" else [])
    for name in impls:
        got = benchmark.BUILDERS[name](case, keep)(q, k, v)
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9, msg=lambda m: f"{name}: {m}")


def test_inputs_are_fresh_random_and_the_mask_keeps_a_key():
    case = benchmark.Case("exp", 2, 4, 2, 64, 16, "bf16", True, 0.9, "cpu")
    gen = torch.Generator().manual_seed(0)
    sets, keep = benchmark.make_inputs(case, 2, gen)
    (q, k, v), do = sets[0]
    assert q.shape == (2, 4, 64, 16) and k.shape == v.shape == (2, 2, 64, 16) and do.shape == q.shape
    assert q.dtype == torch.bfloat16 and q.requires_grad and not do.requires_grad
    assert all(bool((t != 0).any()) for t in (q, k, v, do))
    assert not torch.equal(sets[0].qkv[0], sets[1].qkv[0])
    assert keep.shape == (2, 64) and keep[:, 0].all() and not keep.all()
    # exp logits scale·q·k keep roughly unit spread, so exp() stays finite in bf16
    logits = benchmark.EXP_SCALE * (q.float() @ q.float().transpose(-2, -1))
    assert 0.5 < logits.std() < 2
    assert benchmark.input_set_count(case) == 1  # no cache to defeat on the CPU


def test_baseline_choice():
    def row(impl, ms):
        return dict(impl=impl, ms=ms, baseline=None, vs_baseline=None)

    rows = [row("ours", 1.0), row("flash", 2.0), row("cudnn", 1.6), row("naive", 8.0), row("efficient", None)]
    benchmark.attach_baseline(rows, "sdpa")
    assert [r["baseline"] for r in rows] == ["cudnn"] * 5
    assert rows[0]["vs_baseline"] == pytest.approx(1 / 1.6) and rows[4]["vs_baseline"] is None
    benchmark.attach_baseline(rows, "naive")
    assert rows[0]["baseline"] == "naive" and rows[0]["vs_baseline"] == pytest.approx(1 / 8)


def test_presets_fill_defaults_and_flags_override_them():
    seeds = benchmark.parse_args(["--preset", "seeds", "--device", "cpu", "--dtype", "fp16"])
    assert (seeds.family, seeds.batch, seeds.heads, seeds.dim_head) == ("cosine", [4], [8], [64])
    assert seeds.seq_lens == [128, 256, 512, 1024, 2048, 4096, 8192, 16384]
    assert seeds.causal == (False, True) and seeds.passes == ("fwd", "bwd", "fwd+bwd")
    assert seeds.dtype == "fp16"
    olmo = benchmark.parse_args(["--preset", "olmo2", "--device", "cpu"])
    assert (olmo.batch, olmo.heads, olmo.dim_head, olmo.seq_lens) == ([1], [32, 64], [128], [4096])
    fm = benchmark.parse_args(["--preset", "fastmax-seeds", "--device", "cpu"])
    assert (fm.family, fm.batch, fm.heads, fm.dim_head) == ("fastmax", [64], [8], [32, 64])
    assert fm.seq_lens == [1000, 10000] and fm.passes == ("fwd",)
    assert benchmark.parse_args(["--preset", "fastmax-seeds", "--device", "cpu", "--only-backwards",
                                 "--causal"]).passes == ("bwd",)


@pytest.mark.parametrize("argv, message", [
    (["--seq-lens", "128,abc"], "--seq-lens: expected comma-separated positive integers"),
    (["--seq-lens", "0"], "--seq-lens: expected comma-separated positive integers"),
    (["--heads", "8", "--kv-heads", "3"], "--kv-heads 3: must divide every --heads value"),
    (["--mask-prob", "1"], "--mask-prob: expected a drop probability in [0, 1)"),
    (["--only-forwards", "--only-backwards"], "not allowed with argument"),
    (["--impls", "naive,bogus"], "--impls: ['bogus'] not implementations of --family cosine"),
    (["--family", "exp", "--impls", "fla-parallel"], "not implementations of --family exp"),
    (["--baseline", "cudnn", "--impls", "naive"], "--baseline cudnn: add it to --impls"),
    (["--dtype", "fp8"], "--dtype: invalid choice"),
    (["--repeats", "0"], "--repeats: expected an integer >= 1"),
])
def test_bad_flags_fail_clearly(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        benchmark.parse_args(["--device", "cpu", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_cuda_device_without_a_gpu_fails_clearly(capsys):
    with pytest.raises(SystemExit):
        benchmark.parse_args([])
    assert "--device cuda: no CUDA GPU is visible" in capsys.readouterr().err
