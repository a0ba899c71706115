import ast
import dataclasses
import html
import json
import math
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from wandb.proto import wandb_internal_pb2

import train
from lab.config import TrainConfig, parse_args, parse_command_line
from lab.files import CheckpointWriteError, save_checkpoint
from lab.steps import bpc_by_position
from helpers import REPO, TINY, read_jsonl

STEP_KEYS = {"train/loss", "train/bpc", "lr", "grad_norm", "perf/tokens_per_s", "perf/step_ms", "perf/peak_mem_gib"}
EVAL_KEYS = {"val/loss", "val/bpc", "val/sample", "val/bpc_by_position"}


def read_wandb_log(path: Path) -> list:
    """Records of a .wandb transaction log: a 7-byte header, then leveldb-log records (crc32, length,
    type) of serialized wandb Record protos in 32 KiB blocks, long records split FIRST/MIDDLE/LAST."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, payload, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 or pos + 7 + length > len(data):  # zero fill, or a record still being written
            break
        payload += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            records.append(record)
            payload = b""
    return records


def wandb_records(run_dir: Path, timeout: float = 60.0) -> list:
    """The run's records once its exit record is on disk: wandb's service process writes the log on its
    own schedule, and on a loaded machine run.finish() can return before the last records land."""
    (log,) = run_dir.glob("run-*.wandb")
    deadline = time.monotonic() + timeout
    while True:
        records = read_wandb_log(log)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


def wandb_history(run_dir: Path) -> list[dict]:
    """The logged rows of an offline run; a media value (table, html) is the dict describing its file."""
    rows = []
    for record in wandb_records(run_dir):
        if record.WhichOneof("record_type") == "history":
            row = {}
            for item in record.history.item:
                key, *sub = [item.key] if item.key else list(item.nested_key)
                value = json.loads(item.value_json)
                if sub:
                    row.setdefault(key, {})[sub[0]] = value
                else:
                    row[key] = value
            rows.append(row)
    return rows


def test_training_learns_and_logs_to_jsonl_and_wandb(run):
    assert run("--max_iters", "30", "--run_name", "r") == 0
    run_dir = run.out / "r"
    assert json.loads((run_dir / "config.json").read_text())["n_layer"] == 1
    rows = read_jsonl(run_dir / "metrics.jsonl")
    steps = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 31))
    for r in steps:
        assert STEP_KEYS <= r.keys()
        assert r["train/bpc"] == pytest.approx(r["train/loss"] / math.log(2))
    assert "perf/mfu" not in steps[0]  # no peak FLOP/s known for a CPU
    first = sum(r["train/loss"] for r in steps[:5]) / 5
    last = sum(r["train/loss"] for r in steps[-5:]) / 5
    assert last < first - 0.5, (first, last)

    evals = [r for r in rows if "val/bpc" in r]
    assert [r["step"] for r in evals] == [10, 20, 30]
    for r in evals:
        assert EVAL_KEYS <= r.keys()
        positions = [p for p, _ in r["val/bpc_by_position"]]
        assert positions == [1, 2, 4, 8, 16, 32]
        assert all(math.isfinite(b) for _, b in r["val/bpc_by_position"])
        assert len(r["val/sample"]) > 0
    (test_row,) = [r for r in rows if "test/bpc" in r]
    assert test_row["step"] == 30

    (wandb_run,) = run.wandb_dir.glob("offline-run-*")
    history = wandb_history(wandb_run)
    assert [h["train/loss"] for h in history if "train/loss" in h] == [r["train/loss"] for r in steps]
    assert STEP_KEYS | {"val/loss", "val/bpc", "test/bpc"} <= set().union(*history)
    wandb_evals = [h for h in history if "val/bpc" in h]
    assert [h["val/bpc"] for h in wandb_evals] == [r["val/bpc"] for r in evals]
    last = wandb_evals[-1]
    table = json.loads((wandb_run / "files" / last["val/bpc_by_position_table"]["path"]).read_text())
    assert table["columns"] == ["position", "bpc"] and table["data"] == evals[-1]["val/bpc_by_position"]
    sample_html = (wandb_run / "files" / last["val/sample"]["path"]).read_text()
    assert html.escape(evals[-1]["val/sample"]) in sample_html
    assert [f.name for f in run_dir.iterdir() if f.name.endswith(".tmp")] == []


def test_sample_tokens_zero_logs_no_sample(run):
    assert run("--max_iters", "2", "--eval_interval", "1", "--sample_tokens", "0", "--run_name", "r") == 0
    evals = [r for r in read_jsonl(run.out / "r" / "metrics.jsonl") if "val/bpc" in r]
    assert [r["step"] for r in evals] == [1, 2] and not any("val/sample" in r for r in evals)


def test_resume_reproduces_the_uninterrupted_run_bit_exactly(run):
    assert run("--max_iters", "10", "--lr_decay_iters", "10", "--run_name", "straight") == 0
    assert run("--max_iters", "5", "--lr_decay_iters", "10", "--run_name", "split") == 0
    assert torch.load(run.out / "split" / "ckpt.pt", weights_only=False)["step"] == 5
    with open(run.out / "split" / "metrics.jsonl", "a") as f:  # as if it had crashed at step 6, after the checkpoint
        f.write(json.dumps({"step": 6, "train/loss": 0.0, "grad_norm": 0.0}) + "\n" + '{"step": 7, "tra')
    assert run("--max_iters", "10", "--lr_decay_iters", "10", "--run_name", "split", "--resume", "auto") == 0

    def losses(name):
        return [(r["step"], r["train/loss"], r["grad_norm"])
                for r in read_jsonl(run.out / name / "metrics.jsonl") if "train/loss" in r]

    straight, split = losses("straight"), losses("split")
    assert [s for s, *_ in split] == list(range(1, 11))  # the rows past the checkpoint were dropped
    assert split == straight  # exact float equality, steps 6-10 included


def eval_rows(run_dir: Path) -> list[dict]:
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if "val/bpc" in r or "test/bpc" in r]


# Stopped where a periodic eval is due, and on the last step (which finishes the run, final evals included).
@pytest.mark.parametrize("stop_step, code", [(10, 130), (20, 0)])
def test_a_signal_on_an_eval_step_loses_no_eval(run, monkeypatch, stop_step, code):
    args = ["--max_iters", "20", "--lr_decay_iters", "20", "--wandb-mode", "disabled"]
    assert run(*args, "--run_name", "straight") == 0
    lr_at = train.lr_at

    def lr_at_then_sigterm(step, cfg):  # main() calls it as each 0-based step starts: the signal lands mid-step
        if step + 1 == stop_step:
            signal.raise_signal(signal.SIGTERM)
        return lr_at(step, cfg)

    with monkeypatch.context() as m:
        m.setattr(train, "lr_at", lr_at_then_sigterm)
        assert run(*args, "--run_name", "split") == code
    assert torch.load(run.out / "split" / "ckpt.pt", weights_only=False)["step"] == stop_step
    assert run(*args, "--run_name", "split", "--resume", "auto") == 0
    straight = eval_rows(run.out / "straight")
    assert [r["step"] for r in straight] == [10, 20, 20]  # periodic val; final val and test
    assert eval_rows(run.out / "split") == straight


def test_resuming_a_finished_run_logs_nothing(run, capsys):
    assert run("--max_iters", "4", "--run_name", "r", "--wandb-mode", "disabled") == 0
    metrics = (run.out / "r" / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert run("--max_iters", "4", "--run_name", "r", "--wandb-mode", "disabled", "--resume", "auto") == 0
    assert (run.out / "r" / "metrics.jsonl").read_text() == metrics  # the final evals were not logged again
    assert "already complete" in capsys.readouterr().out


def test_existing_checkpoint_needs_resume_and_the_same_config(run, capsys):
    assert run("--max_iters", "2", "--run_name", "r") == 0
    with pytest.raises(SystemExit) as exc:
        run("--max_iters", "2", "--run_name", "r")
    assert exc.value.code == 2 and "--resume auto" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        run("--max_iters", "4", "--run_name", "r", "--resume", "auto", "--n_embd", "64")
    assert exc.value.code == 2 and "n_embd" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        run("--run_name", "other", "--resume", str(run.out / "missing.pt"))
    assert exc.value.code == 2 and "missing.pt" in capsys.readouterr().err


@pytest.mark.parametrize("args, expected", [
    (["--n_layer", "abc"], "--n-layer: invalid int value: 'abc'"),
    (["--attention", "foo"], "attention: expected one of"),
    (["--lr=-1"], "lr: expected > 0"),
    (["--min_lr", "1.0"], "min_lr"),
    (["--bogus", "3"], "unrecognized arguments: --bogus"),
    (["--use-cuda-kernel", "maybe"], "--use-cuda-kernel: invalid bool or auto value"),
    (["--use-cuda-kernel"], "use_cuda_kernel: our CUDA kernels cannot run this config: training runs on cpu"),
    (["--attention", "softmax", "--use-cuda-kernel"], "use_cuda_kernel: softmax"),
    (["--data-path", "/nonexistent/enwik8"], "/nonexistent/enwik8 does not exist"),
    (["--config", "configs/nope"], "no config file at configs/nope or configs/nope.py"),
    (["--lr", "inf"], "lr: expected a finite number, got inf"),
    (["--weight_decay", "inf"], "weight_decay: expected a finite number, got inf"),
    (["--cosine_scale", "inf"], "cosine_scale: expected a finite number, got inf"),
    (["--fastmax_a0", "nan"], "fastmax_a0: expected a finite number, got nan"),
    (["--seed", "4294967296"], "seed: expected an int in [0, 2**32), got 4294967296"),
    (["--seed=-1"], "seed: expected an int in [0, 2**32), got -1"),
    (["--dtype", "float16"], "dtype: expected one of ('auto', 'bfloat16', 'float32'), got 'float16'"),
])
def test_bad_input_is_a_usage_error_naming_the_problem(run, capsys, args, expected):
    with pytest.raises(SystemExit) as exc:
        run(*args)
    assert exc.value.code == 2
    assert expected in capsys.readouterr().err


def test_a_split_shorter_than_a_window_is_refused_before_training(run, capsys, tmp_path):
    small = tmp_path / "small"
    small.write_bytes(bytes(range(256)) * 400)  # 102,400 bytes: train 92,160, val and test 5,120 each
    with pytest.raises(SystemExit) as exc:
        run("--data-path", str(small), "--seq_len", "8192", "--run_name", "r")
    assert exc.value.code == 2
    assert "seq_len: 8192 needs windows of seq_len + 1 bytes, but the val split of the data has 5,120" \
        in capsys.readouterr().err
    assert not (run.out / "r").exists()


@pytest.mark.parametrize("line, expected", [
    ("n_layerz = 2", "unknown config field 'n_layerz' (did you mean 'n_layer'?)"),
    ("n_layer = 'two'", "n_layer: expected int, got 'two'"),
    ("use_cuda_kernel = 1", "use_cuda_kernel: expected bool or auto, got 1"),
    ("n_layer = 2 * 3", "n_layer: expected a literal value"),
    ("import os", "expected a `name = literal` line"),
    ("n_layer =", "not a `name = literal` line"),
])
def test_bad_config_file_names_the_line_and_field(tmp_path, capsys, line, expected):
    config = tmp_path / "bad.py"
    config.write_text(f"# a comment\nn_embd = 64\n{line}\n")
    with pytest.raises(SystemExit) as exc:
        parse_args(["--config", str(config)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"{config}:3" in err and expected in err


def test_a_config_value_that_overflows_to_inf_is_refused(tmp_path, capsys):
    config = tmp_path / "huge.py"
    config.write_text("lr = 1e999\n")
    with pytest.raises(SystemExit) as exc:
        parse_args(["--config", str(config)])
    assert exc.value.code == 2 and "lr: expected a finite number, got inf" in capsys.readouterr().err


def test_a_config_file_that_is_not_utf8_is_named(tmp_path, capsys):
    config = tmp_path / "latin1.py"
    config.write_bytes("# caf\xe9\nn_layer = 2\n".encode("latin-1"))
    with pytest.raises(SystemExit) as exc:
        parse_args(["--config", str(config)])
    assert exc.value.code == 2 and f"{config}: not UTF-8 text" in capsys.readouterr().err


def test_config_file_then_overrides():
    cfg, resume = parse_args(["--config", str(REPO / "configs" / "tiny_cpu.py"), "--n-layer=3",
                                    "--fastmax_normalize", "--cosine_scale", "8", "--n_kv_head", "none"])
    assert (cfg.n_layer, cfg.fastmax_normalize, cfg.cosine_scale, cfg.n_kv_head) == (3, True, 8.0, cfg.n_head)
    assert cfg.run_name == f"tiny_cpu_{cfg.attention}" and resume is None


def test_the_default_config_follows_the_device(monkeypatch):
    monkeypatch.setattr(train.torch.cuda, "is_available", lambda: False)
    cli = parse_command_line([])
    assert cli.values["seq_len"] == 128 and cli.values["run_name"] == "tiny_cpu_cosine"
    assert "no CUDA device" in cli.note and "--config configs/base" in cli.note
    assert parse_command_line(["--device", "cuda"]).values["seq_len"] == 8192  # asked for a GPU: base
    monkeypatch.setattr(train.torch.cuda, "is_available", lambda: True)
    cli = parse_command_line([])
    assert cli.values["seq_len"] == 8192 and cli.note is None
    assert parse_command_line(["--device", "cpu"]).values["seq_len"] == 128


def test_help_describes_every_field_with_its_choices_and_the_config_value(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--config", str(REPO / "configs" / "tiny_cpu"), "--help"])
    assert exc.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "attention family; one of softmax, cosine, fastmax (default 'cosine' from configs/tiny_cpu)" in out
    assert "peak learning rate (default 0.002 from configs/tiny_cpu)" in out
    assert "AdamW beta2 (default 0.95)" in out
    for field in dataclasses.fields(TrainConfig):
        assert field.metadata["help"].split(";")[0] in out, field.name


def test_lr_schedule():
    cfg = TrainConfig(lr=1.0, min_lr=0.1, warmup_iters=10, max_iters=110)
    lrs = [train.lr_at(s, cfg) for s in range(120)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert lrs[60] == pytest.approx(0.55)  # halfway through the cosine
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    assert lrs[110:] == [0.1] * 10


def test_bpc_by_position_buckets():
    loss_sum = torch.full((10,), 2 * math.log(2), dtype=torch.float64)  # 2 bits at every position...
    loss_sum[0] = 0.0  # ...but the first
    count = torch.ones(10, dtype=torch.float64)
    assert bpc_by_position(loss_sum, count) == [(1, 0.0), (2, 2.0), (4, 2.0), (8, 2.0), (10, 2.0)]
    count[4:8] = 0  # positions 5-8 never scored: no bucket for them
    assert [p for p, _ in bpc_by_position(loss_sum, count)] == [1, 2, 4, 10]


def test_train_py_reads_in_steps_of_at_most_60_lines():
    """Issue 58's rule: a reader follows train.py top to bottom, no function longer than 60 lines."""
    tree = ast.parse(Path(train.__file__).read_text())
    lengths = {node.name: node.end_lineno - node.lineno + 1 for node in ast.walk(tree)
               if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    assert "run" in lengths
    assert {name: n for name, n in lengths.items() if n > 60} == {}


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.pt"
    save_checkpoint({"step": 1}, path)
    save_checkpoint({"step": 2}, path)
    assert torch.load(path)["step"] == 2
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]

    def crash_midway(obj, f):
        f.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(train.torch, "save", crash_midway)
    with pytest.raises(CheckpointWriteError, match="OSError: disk full; .* still holds the previous checkpoint"):
        save_checkpoint({"step": 3}, path)
    assert torch.load(path)["step"] == 2
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]


def test_sigterm_saves_a_checkpoint_and_exits_130(tmp_path, data_path):
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, str(REPO / "train.py"), *TINY, "--data-path", data_path,
                             "--out_dir", str(out), "--run_name", "r", "--max_iters", "100000",
                             "--eval_interval", "100000", "--wandb-mode", "disabled"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = out / "r" / "metrics.jsonl"
    deadline = time.monotonic() + 60
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, output
    assert "stopped by SIGTERM" in output
    last_step = read_jsonl(metrics)[-1]["step"]
    assert torch.load(out / "r" / "ckpt.pt", weights_only=False)["step"] == last_step


def test_resume_under_another_run_name_starts_a_new_wandb_run(run):
    assert run("--max_iters", "4", "--lr_decay_iters", "4", "--run_name", "a") == 0
    assert run("--max_iters", "6", "--lr_decay_iters", "4", "--run_name", "a", "--resume", "auto") == 0
    assert run("--max_iters", "8", "--lr_decay_iters", "4", "--run_name", "b",
               "--resume", str(run.out / "a" / "ckpt.pt")) == 0
    # offline-run-<time>-<id>, and -<n> after it when a run id is resumed in the same second
    ids = [d.name.split("-")[3] for d in run.wandb_dir.glob("offline-run-*")]
    assert len(ids) == 3 and len(set(ids)) == 2  # the resume of "a" continues its run, "b" is new
