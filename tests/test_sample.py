"""Sampling: the nucleus and top-k filters, and sample.py from a checkpoint that train.py wrote (streamed
output, seeds, CPU fallback from the kernels, bad prompts, options and files named)."""
import json
import subprocess
import sys

import pytest
import torch

import sample
import train
from lab.files import load_checkpoint
from model.gpt import sample_next
from helpers import REPO, TINY


def draws(logits, n=4000, **options) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.cat([sample_next(logits, generator=generator, **options) for _ in range(n)]).flatten()


def test_top_p_keeps_the_smallest_set_that_reaches_p_and_always_the_most_likely_byte():
    probs = torch.zeros(1, 256)
    probs[0, [7, 8, 9, 10]] = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    assert set(draws(logits, top_p=0.8).tolist()) == {7, 8}  # 0.5 + 0.3 reaches 0.8: byte 9 is left out
    assert set(draws(logits, top_p=0.81).tolist()) == {7, 8, 9}
    assert set(draws(logits, top_p=0.01).tolist()) == {7}
    assert set(draws(logits, top_p=1.0).tolist()) == {7, 8, 9, 10}
    share = (draws(logits, top_p=0.8) == 7).float().mean().item()
    assert share == pytest.approx(0.5 / 0.8, abs=0.03)  # renormalised within the set
    assert set(draws(logits, top_k=3, top_p=0.99).tolist()) == {7, 8, 9}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, data_path):
    out = tmp_path_factory.mktemp("sample") / "out"
    assert train.main([*TINY, "--data-path", data_path, "--out_dir", str(out), "--run_name", "r", "--max_iters", "4",
                       "--wandb-mode", "disabled"]) == 0
    return out / "r"


def test_sample_streams_the_prompt_and_new_bytes_and_a_seed_repeats_them(checkpoint, capsys):
    args = ["--ckpt", str(checkpoint), "--prompt", "The city of ", "--max-new-bytes", "40", "--seed", "3"]
    assert sample.main(args) == 0
    first = capsys.readouterr().out
    assert first.startswith("The city of ") and first.endswith("\n")
    assert sample.main([*args[:-1], "3"]) == 0
    assert capsys.readouterr().out == first
    assert sample.main([*args[:-1], "4", "--ckpt", str(checkpoint / "ckpt.pt")]) == 0
    assert capsys.readouterr().out != first  # another seed draws other bytes


def test_greedy_sampling_is_the_model_argmax(checkpoint, capsys):
    assert sample.main(["--ckpt", str(checkpoint), "--prompt", "ab", "--max-new-bytes", "5", "--top-k", "1"]) == 0
    text = capsys.readouterr().out.rstrip("\n").encode("utf-8")
    model, _, _ = sample.load_model(sample.parse_args(["--ckpt", str(checkpoint), "--prompt", "x"]))
    idx = torch.tensor([list(b"ab")])
    for _ in range(5):
        logits, _ = model(idx)
        idx = torch.cat([idx, logits[:, -1:].argmax(-1)], dim=1)
    want = bytes(idx[0].tolist()).decode("utf-8", errors="replace").encode("utf-8")
    assert text == want


def test_a_prompt_file_and_a_prompt_longer_than_the_context(checkpoint, tmp_path, capsys):
    path = tmp_path / "prompt.txt"
    path.write_bytes(b"x" * 100)  # seq_len is 32
    assert sample.main(["--ckpt", str(checkpoint), "--prompt-file", str(path), "--max-new-bytes", "3"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("x" * 100)
    assert "the prompt has 100 bytes; the model sees the last 32" in captured.err


def test_a_kernel_run_samples_on_the_cpu_with_the_reference(checkpoint, tmp_path, capsys):
    ckpt = load_checkpoint(checkpoint / "ckpt.pt")
    ckpt["config"]["use_cuda_kernel"] = True
    torch.save(ckpt, tmp_path / "kernel.pt")
    assert sample.main(["--ckpt", str(tmp_path / "kernel.pt"), "--prompt", "a", "--max-new-bytes", "2",
                        "--device", "cpu"]) == 0
    assert "PyTorch reference of the same cosine attention" in capsys.readouterr().err


@pytest.mark.parametrize("args, expected", [
    (["--prompt", ""], "--prompt: expected at least one character"),
    (["--prompt", "a", "--temperature", "0"], "--temperature: expected a finite number > 0"),
    (["--prompt", "a", "--top-k", "0"], "--top-k: expected None or an int in [1, 256]"),
    (["--prompt", "a", "--top-p", "1.5"], "--top-p: expected None or a number in (0, 1]"),
    (["--prompt", "a", "--max-new-bytes", "-1"], "--max-new-bytes: expected an int >= 0"),
    (["--prompt-file", "/nonexistent/p.txt"], "--prompt-file: cannot read /nonexistent/p.txt"),
])
def test_bad_options_are_usage_errors_naming_the_option(checkpoint, capsys, args, expected):
    with pytest.raises(SystemExit) as exc:
        sample.main(["--ckpt", str(checkpoint), *args])
    assert exc.value.code == 2 and expected in capsys.readouterr().err


def test_an_empty_prompt_file_and_a_bad_checkpoint_are_named(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(SystemExit):
        sample.main(["--ckpt", "x", "--prompt-file", str(empty)])
    assert f"--prompt-file: {empty} is empty" in capsys.readouterr().err
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint")
    with pytest.raises(SystemExit):
        sample.main(["--ckpt", str(junk), "--prompt", "a"])
    assert f"--ckpt: {junk} is not a checkpoint written by train.py" in capsys.readouterr().err


def test_the_command_line_streams_from_a_checkpoint(checkpoint):
    done = subprocess.run([sys.executable, str(REPO / "sample.py"), "--ckpt", str(checkpoint), "--prompt", "Hi",
                           "--max-new-bytes", "8"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("Hi")


def test_the_decode_benchmark_times_both_paths(tmp_path):
    out = tmp_path / "decode.json"
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "decode.py"), "--config", "configs/tiny_cpu",
                           "--contexts", "64,128", "--batches", "1,2", "--new-bytes", "4", "--no-cache-max", "64",
                           "--device", "cpu", "--variants", "softmax,fastmax", "--json", str(out)],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r["variant"], r["context"], r["batch"]) for r in rows] == [
        (v, t, b) for v in ("softmax", "fastmax") for t in (64, 128) for b in (1, 2)]
    assert all(r["ms_per_byte"] > 0 for r in rows)
    assert all(("no_cache_ms_per_byte" in r) == (r["context"] <= 64) for r in rows)
