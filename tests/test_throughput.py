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
