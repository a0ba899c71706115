"""A long run's bad day: resumes on other data, corrupt files, killed writes, divergence and late signals.

Each ends in a clear error naming the file, field or argument, and no good checkpoint or metrics row is lost.
"""
import fcntl
import json
import math
import signal

import pytest
import torch

import train
from lab.files import json_line, load_checkpoint
from helpers import TINY, read_jsonl


def strict_rows(path):
    """metrics.jsonl as a strict JSON parser reads it: bare NaN or Infinity tokens are errors."""
    def refuse(token):
        raise ValueError(f"not strict JSON: {token}")
    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def usage_error(run, capsys, *args) -> str:
    with pytest.raises(SystemExit) as exc:
        run(*args)
    assert exc.value.code == 2
    return capsys.readouterr().err


# ----------------------------------------------------------------------------- resume

def test_a_finished_run_trains_on_with_a_larger_max_iters_at_min_lr(run):
    assert run("--max_iters", "6", "--run_name", "r") == 0
    assert run("--max_iters", "9", "--run_name", "r", "--resume", "auto") == 0
    rows = [r for r in read_jsonl(run.out / "r" / "metrics.jsonl") if "lr" in r]
    assert [r["step"] for r in rows] == list(range(1, 10))
    cfg = load_checkpoint(run.out / "r" / "ckpt.pt")["config"]
    assert cfg["lr_decay_iters"] == 6 and cfg["max_iters"] == 9  # the cosine ends where the run's ended
    assert [r["lr"] for r in rows[6:]] == [cfg["min_lr"]] * 3


def test_a_resume_without_data_path_reads_the_runs_data(tmp_path, data_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    out = str(tmp_path / "out")
    assert train.main([*TINY, "--data-path", data_path, "--out_dir", out, "--run_name", "r", "--max_iters", "3"]) == 0
    assert train.main([*TINY, "--out_dir", out, "--run_name", "r", "--max_iters", "5", "--resume", "auto"]) == 0
    assert load_checkpoint(tmp_path / "out" / "r" / "ckpt.pt")["config"]["data_path"] == data_path


def test_a_resume_on_other_data_is_refused_and_a_copy_is_fine(run, capsys, data_path, tmp_path):
    assert run("--max_iters", "3", "--run_name", "r", "--wandb-mode", "disabled") == 0
    original = open(data_path, "rb").read()
    copy, changed = tmp_path / "copy", tmp_path / "changed"
    copy.write_bytes(original)
    changed.write_bytes(original[:1000] + bytes([original[1000] ^ 1]) + original[1001:])  # one bit
    err = usage_error(run, capsys, "--max_iters", "5", "--run_name", "r", "--resume", "auto",
                      "--data-path", str(changed))
    assert "the data differs from the checkpoint's" in err and str(changed) in err and data_path in err
    assert run("--max_iters", "5", "--run_name", "r", "--resume", "auto", "--data-path", str(copy),
               "--wandb-mode", "disabled") == 0


# ----------------------------------------------------------------------------- checkpoints

def corrupt_zero_bytes(path):
    path.write_bytes(b"")


def corrupt_random_bytes(path):
    path.write_bytes(torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0),
                                   dtype=torch.uint8).numpy().tobytes())


def corrupt_no_config(path):
    state = torch.load(path, weights_only=False)
    del state["config"]
    torch.save(state, path)


def corrupt_not_a_dict(path):
    torch.save([1, 2, 3], path)


def corrupt_one_flipped_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40  # inside the weights' storage
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("corrupt, expected", [
    (corrupt_zero_bytes, "is not a checkpoint written by train.py"),
    (corrupt_random_bytes, "is not a checkpoint written by train.py"),
    (corrupt_no_config, "is not a checkpoint written by this train.py (missing config)"),
    (corrupt_not_a_dict, "is not a checkpoint written by this train.py (expected a dict"),
    (corrupt_one_flipped_byte, "fails its CRC-32 check"),
])
def test_a_corrupt_checkpoint_is_refused_naming_the_file(run, capsys, corrupt, expected):
    assert run("--max_iters", "2", "--run_name", "r", "--wandb-mode", "disabled") == 0
    ckpt = run.out / "r" / "ckpt.pt"
    corrupt(ckpt)
    err = usage_error(run, capsys, "--max_iters", "4", "--run_name", "r", "--resume", "auto")
    assert f"--resume: {ckpt}" in err and expected in err


# ----------------------------------------------------------------------------- the run directory and its files

def test_a_garbage_metrics_line_is_named_and_nothing_is_rewritten(run, capsys):
    assert run("--max_iters", "2", "--run_name", "r", "--wandb-mode", "disabled") == 0
    metrics = run.out / "r" / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    metrics.write_text(lines[0] + "this is not json\n" + "".join(lines[1:]))
    before = metrics.read_text()
    err = usage_error(run, capsys, "--max_iters", "4", "--run_name", "r", "--resume", "auto")
    assert f"{metrics}:2: not a metrics row" in err
    assert metrics.read_text() == before


def test_the_metrics_rewrite_on_resume_is_atomic(run, monkeypatch):
    assert run("--max_iters", "2", "--run_name", "r", "--wandb-mode", "disabled") == 0
    metrics = run.out / "r" / "metrics.jsonl"
    with open(metrics, "a") as f:  # rows past the checkpoint, which the resume drops by rewriting the file
        f.write(json.dumps({"step": 3, "train/loss": 1.0}) + "\n")
    before = metrics.read_text()

    def killed_mid_write(fd):
        raise KeyboardInterrupt  # stands in for the process dying before the rename

    monkeypatch.setattr(train.os, "fsync", killed_mid_write)
    with pytest.raises(KeyboardInterrupt):
        run("--max_iters", "4", "--run_name", "r", "--resume", "auto", "--wandb-mode", "disabled")
    assert metrics.read_text() == before
    assert [p.name for p in metrics.parent.iterdir() if p.name.endswith(".tmp")] == []


def test_temp_files_of_killed_writes_are_removed_by_the_next_run(run):
    assert run("--max_iters", "2", "--run_name", "r", "--wandb-mode", "disabled") == 0
    run_dir = run.out / "r"
    for name in (".ckpt.pt.abc123.tmp", ".metrics.jsonl.def456.tmp"):
        (run_dir / name).write_bytes(b"half a file")
    assert run("--max_iters", "3", "--run_name", "r", "--resume", "auto", "--wandb-mode", "disabled") == 0
    assert sorted(p.name for p in run_dir.iterdir()) == [".lock", "ckpt.pt", "config.json", "metrics.jsonl"]


def test_a_second_train_py_on_the_same_run_directory_is_refused(run, capsys):
    run_dir = run.out / "r"
    run_dir.mkdir(parents=True)
    with open(run_dir / ".lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as the other process would
        err = usage_error(run, capsys, "--max_iters", "2", "--run_name", "r", "--wandb-mode", "disabled")
    assert f"{run_dir} is in use by another train.py" in err
    assert not (run_dir / "metrics.jsonl").exists()


def test_json_lines_are_strict():
    line = json_line({"step": 1, "loss": math.nan, "curve": [(1, math.inf), (2, 1.5)], "s": "x"})
    assert json.loads(line) == {"step": 1, "loss": None, "curve": [[1, None], [2, 1.5]], "s": "x"}


# ----------------------------------------------------------------------------- divergence

def test_divergence_stops_with_its_exit_code_and_keeps_the_last_good_checkpoint(run, capsys):
    code = run("--max_iters", "40", "--lr", "1e6", "--min_lr", "0", "--warmup_iters", "0", "--ckpt_interval", "1",
               "--eval_interval", "1000", "--sample_tokens", "0", "--run_name", "r")
    assert code == train.EXIT_DIVERGED
    err = capsys.readouterr().err
    assert "training diverged" in err and "Lower --lr" in err
    rows = strict_rows(run.out / "r" / "metrics.jsonl")
    last_logged = rows[-1]["step"]
    assert last_logged < 40 and all(math.isfinite(r["train/loss"]) for r in rows)
    ckpt = load_checkpoint(run.out / "r" / "ckpt.pt")
    assert ckpt["step"] == last_logged and f"still holds step {last_logged}" in err
    assert all(t.isfinite().all() for t in ckpt["model"].values())


def test_a_non_finite_gradient_takes_no_step(run, capsys, monkeypatch):
    assert run("--max_iters", "2", "--run_name", "r", "--wandb-mode", "disabled") == 0
    good = load_checkpoint(run.out / "r" / "ckpt.pt")
    clip = train.clip_gradients
    monkeypatch.setattr(train, "clip_gradients", lambda model, cfg: clip(model, cfg) * math.nan)
    assert run("--max_iters", "4", "--run_name", "r", "--resume", "auto", "--wandb-mode", "disabled") == 3
    assert "step 3 has training loss" in capsys.readouterr().err
    after = load_checkpoint(run.out / "r" / "ckpt.pt")
    assert after["step"] == 2 and all(torch.equal(after["model"][k], v) for k, v in good["model"].items())


def test_a_non_finite_evaluation_stops_the_run(run, capsys, monkeypatch):
    evaluate = train.evaluate
    monkeypatch.setattr(train, "evaluate", lambda *a, **k: (math.nan, evaluate(*a, **k)[1]))
    assert run("--max_iters", "10", "--run_name", "r", "--wandb-mode", "disabled") == train.EXIT_DIVERGED
    err = capsys.readouterr().err
    assert "the val loss is nan at step 10" in err and "no checkpoint was written" in err
    assert not (run.out / "r" / "ckpt.pt").exists()


# ----------------------------------------------------------------------------- signals

def test_a_signal_during_the_final_log_close_keeps_the_exit_code(run, monkeypatch):
    """SIGTERM while wandb finishes: the run has finished, so 0, not death by signal (-15)."""
    late = []

    def outside_handler(signum, frame):  # what a signal would reach if train.py had let go of it
        late.append(signum)

    previous = signal.signal(signal.SIGTERM, outside_handler)
    close = train.RunLog.close

    def close_under_a_signal(self, exit_code):
        signal.raise_signal(signal.SIGTERM)
        close(self, exit_code)

    monkeypatch.setattr(train.RunLog, "close", close_under_a_signal)
    try:
        assert run("--max_iters", "2", "--run_name", "r", "--wandb-mode", "disabled") == 0
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert late == []
