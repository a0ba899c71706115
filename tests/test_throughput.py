"""scripts/throughput.py on CPU: every variant that runs there, the report, refusals and bad arguments."""
import importlib.util
import json

import pytest

from helpers import REPO

spec = importlib.util.spec_from_file_location("throughput", REPO / "scripts" / "throughput.py")
throughput = importlib.util.module_from_spec(spec)
spec.loader.exec_module(throughput)

TINY = ["--device", "cpu", "--seq-lens", "32,64", "--tokens-per-step", "128", "--warmup", "1", "--steps", "1"]
TINY_MODEL = ["--config", "configs/tiny_cpu", "--n_layer", "1", "--n_head", "2", "--n_embd", "32"]


def test_throughput_times_each_variant_and_length_and_reports(tmp_path):
    out = tmp_path / "tp"
    variants = "softmax,cosine-sdpa,cosine,fastmax,cosine-kernel"
    assert throughput.main([*TINY, "--variants", variants, "--out", str(out), "--", *TINY_MODEL]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    rows = {(r["variant"], r["seq_len"]): r for r in report["results"]}
    assert sorted(rows) == sorted((v, n) for v in variants.split(",") for n in (32, 64))
    for (variant, seq_len), r in rows.items():
        assert r["batch_size"] == 128 // seq_len
        if variant in ("cosine-kernel", "cosine-sdpa"):  # no CUDA here (our kernels, SDPA's cuDNN): refused
            assert not r["ok"] and r["reason"] == "refused" and "CUDA" in r["detail"]  # with the reason
        else:
            assert r["ok"] and r["tokens_per_s"] > 0 and r["step_ms"] > 0 and r["peak_mem_gib"] > 0
    table = out.with_suffix(".md").read_text()
    assert "| cosine-sdpa | refused" in table and "| cosine | " in table and "refused" in table


@pytest.mark.parametrize("args, expected", [
    (["--variants", "softmax,flash4"], "--variants: expected a comma list"),
    (["--seq-lens", "64,x"], "--seq-lens: invalid comma-separated positive int value: '64,x'"),
    (["--seq-lens", "0"], "--seq-lens: invalid comma-separated positive int value: '0'"),
    (["--steps", "0"], "--steps: expected > 0"),
])
def test_throughput_bad_arguments_are_usage_errors(capsys, args, expected):
    with pytest.raises(SystemExit) as e:
        throughput.main(args)
    assert e.value.code == 2 and expected in capsys.readouterr().err


def test_profile_says_where_a_training_step_goes(tmp_path):
    """--profile adds, per variant and length, the step's time by category (on a CPU the ops' own time): the
    categories add up to the whole, the model's matmuls are among them, and the report has the table."""
    out = tmp_path / "tp"
    assert throughput.main([*TINY, "--seq-lens", "32", "--variants", "softmax,fastmax", "--profile", "--out", str(out),
                            "--", *TINY_MODEL]) == 0
    for r in json.loads(out.with_suffix(".json").read_text())["results"]:
        profile = r["profile"]
        assert profile["categories"]["matmul"] > 0 and profile["wall_ms"] > 0
        assert sum(profile["categories"].values()) == pytest.approx(profile["busy_ms"])
        assert profile["top"][0]["ms"] >= profile["top"][-1]["ms"]
    table = out.with_suffix(".md").read_text()
    assert "| ms per step (share) | softmax 32 | fastmax 32 |" in table and "| matmul | " in table


def test_decode_benchmark_times_and_profiles_a_step(tmp_path):
    """scripts/decode.py on a CPU: a row per variant, context and batch with the step's cost, the path without
    the cache beside it, and with --profile where the step's time goes."""
    spec = importlib.util.spec_from_file_location("decode", REPO / "scripts" / "decode.py")
    decode = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(decode)
    out = tmp_path / "decode.json"
    assert decode.main(["--config", "configs/tiny_cpu", "--contexts", "40", "--batches", "1,2", "--new-bytes", "4",
                        "--device", "cpu", "--profile", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["variant"], r["batch"]) for r in rows] == [(v, b) for v in ("softmax", "cosine", "fastmax") for b in (1, 2)]
    for r in rows:
        assert r["ms_per_byte"] > 0 and r["no_cache_ms_per_byte"] > 0 and r["profile"]["busy_ms"] > 0
    with pytest.raises(SystemExit):
        decode.main(["--config", "configs/tiny_cpu", "--contexts", "8", "--new-bytes", "4", "--device", "cpu",
                     "--profile"])
