"""Running the study's jobs on every GPU from a shared queue (in turn on a CPU), resumable.

A throughput job has its GPU alone; training runs, whose timings the report does not use, share each GPU
``per_device`` at a time (the study's small models leave most of one idle). Consecutive jobs of one kind
run as one batch; the next batch starts when it is done.

A job is one or more scripts run in turn (``python train.py ...``, then for grid runs
``python scripts/evaluate.py ...`` on its best checkpoint), each in a subprocess of its own, pinned to one GPU
by CUDA_VISIBLE_DEVICES; train.py runs with ``--resume auto``, so a job a killed study left half done continues
from its checkpoint. A job ends in its run folder's result.json: status "ok" with the summary of what it
measured, or the reason it failed. A job whose result.json says ok is not run again; a failed or stopped one
is. Past the deadline, running jobs get SIGTERM (train.py saves and exits) and no new ones start: a later call
goes on from there.
"""
from __future__ import annotations

import itertools
import json
import os
import queue
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from lab.files import write_atomically
from study.jobs import Job

ROOT = Path(__file__).resolve().parents[1]
STOP_GRACE_S = 60  # after SIGTERM, how long a run may take to save its checkpoint before it is killed


def command_lines(job: Job) -> list[list[str]]:
    """A job's commands as results record them: `python script args...` each."""
    return [["python", *command] for command in job.commands]


def result_path(run_dir: Path) -> Path:
    return run_dir / "result.json"


def read_result(run_dir: Path) -> dict | None:
    path = result_path(run_dir)
    return json.loads(path.read_text()) if path.exists() else None


def summarize(run_dir: Path) -> dict:
    """The numbers the report needs from a finished training run's metrics.jsonl: the final evaluations, the
    best periodic val bpc and its step (the best-val checkpoint's, with --keep_best), the training bpc where the
    run ended and at the best step, and the last evaluation's attention diagnostics."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/loss" in r]
    evals = [r for r in rows if "val/loss" in r]
    tests = [r for r in rows if "test/loss" in r]
    speeds = [r["perf/tokens_per_s"] for r in steps[1:] or steps]  # step 1 carries the warm-up
    tail = steps[-max(1, len(steps) // 20):]  # the last 5% of steps: the training loss where the run ended
    best = min(evals, key=lambda e: e["val/loss"])  # the final evaluation scores the periodic windows too
    near = [r for r in steps if r["step"] <= best["step"]][-max(1, len(steps) // 20):]
    summary = {"steps": steps[-1]["step"], "train_s": sum(r["perf/step_ms"] for r in steps) / 1000,
               "tokens_per_s": statistics.median(speeds), "peak_mem_gib": max(r["perf/peak_mem_gib"] for r in steps),
               "train_bpc": statistics.fmean(r["train/bpc"] for r in tail),
               "train_bpc_at_best": statistics.fmean(r["train/bpc"] for r in near),
               "best_val_bpc": best["val/bpc"], "best_step": best["step"],
               "val_curve": [[e["step"], e.get("val/bpc"), e.get("val/accuracy")] for e in evals]}
    final, test = evals[-1], tests[-1]
    for split, row in (("val", final), ("test", test)):
        for key in ("bpc", "bpc_by_position", "accuracy"):
            if f"{split}/{key}" in row:
                summary[f"{split}_{key}"] = row[f"{split}/{key}"]
    attention = {k[len("val/attn/"):]: v for k, v in final.items() if k.startswith("val/attn/")}
    if attention:
        summary["attention"] = attention
    return summary


class StudyError(Exception):
    """A study that cannot go on as asked; the message says why and what to do."""


class Runner:
    """Runs jobs on workers (one per device for exclusive jobs, per_device per device for the others) until
    the queue is empty or the deadline passes."""

    def __init__(self, runs_dir: Path, devices: list[str | None], deadline: float, log=print, per_device: int = 1,
                 gpus: dict[str | None, str] | None = None):
        """devices: the GPUs this process sees, as indices (None: the CPU); gpus: device -> its name, recorded in
        each result, since a resumed study's runs may have trained on different machines."""
        self.runs_dir, self.devices, self.deadline, self.log = runs_dir, devices, deadline, log
        self.per_device, self.gpus = per_device, gpus or {}
        self.lock = threading.Lock()

    def run_dir(self, job: Job) -> Path:
        return self.runs_dir / job.name

    def pending(self, jobs: list[Job]) -> list[Job]:
        """The jobs without an ok result."""
        return [j for j in jobs if (read_result(self.run_dir(j)) or {}).get("status") != "ok"]

    def check_foreign(self, jobs: list[Job]) -> None:
        """Raise StudyError when a job's folder holds a run of other commands (another protocol under the
        same study name): resuming it, or taking its result, would mix two protocols in one report."""
        foreign = [j.name for j in jobs
                   if (r := read_result(self.run_dir(j))) is not None and r["commands"] != command_lines(j)]
        if foreign:
            raise StudyError(f"{self.runs_dir} holds runs made with other settings ({', '.join(foreign[:3])}"
                             f"{' ...' if len(foreign) > 3 else ''}): give this study another --name, or remove them")

    def run(self, jobs: list[Job]) -> bool:
        """Run the pending jobs; True when every job of the list has an ok result."""
        self.check_foreign(jobs)
        for exclusive, batch in itertools.groupby(self.pending(jobs), key=lambda j: j.exclusive):
            todo = queue.Queue()
            for job in batch:
                todo.put(job)
            workers = [threading.Thread(target=self._work, args=(todo, device), daemon=True)
                       for device in self.devices for _ in range(1 if exclusive else self.per_device)]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
        return not self.pending(jobs)

    def _work(self, todo: queue.Queue, device: str | None) -> None:
        while time.monotonic() < self.deadline:
            try:
                job = todo.get_nowait()
            except queue.Empty:
                return
            result = self._execute(job, device)
            write_atomically(result_path(self.run_dir(job)), lambda f: f.write((json.dumps(result) + "\n").encode()))
            with self.lock:
                self.log(f"{job.name}: {result['status']}" + (f" (GPU {device})" if device is not None else ""))

    def _subprocess(self, command: list[str], log_path: Path, device: str | None) -> tuple[int, bool]:
        """(exit code, whether the deadline stopped it)."""
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if device is not None:  # an index among the GPUs this process sees, which CUDA_VISIBLE_DEVICES may choose
            chosen = os.environ.get("CUDA_VISIBLE_DEVICES")
            env["CUDA_VISIBLE_DEVICES"] = chosen.split(",")[int(device)] if chosen else device
        with open(log_path, "a") as log:
            log.write("$ " + shlex.join(command) + "\n")
            log.flush()
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
            try:
                return proc.wait(timeout=max(0.0, self.deadline - time.monotonic())), False
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                return proc.returncode, True

    def _execute(self, job: Job, device: str | None) -> dict:
        run_dir = self.run_dir(job)
        run_dir.mkdir(parents=True, exist_ok=True)
        log_path = run_dir / "study.log"
        t0 = time.monotonic()
        record = {"name": job.name, "phase": job.phase, "variant": job.variant, "conv": job.conv,
                  "seq_len": job.seq_len, "seed": job.seed, "lr": job.lr, "steps": job.steps, "pairs": job.pairs,
                  "commands": command_lines(job), "gpu": self.gpus.get(device)}
        code, stopped = 0, False
        for script, *argv in job.commands:
            code, stopped = self._subprocess([sys.executable, str(ROOT / script), *argv], log_path, device)
            if code != 0 or stopped:
                break
        record["wall_s"] = time.monotonic() - t0
        if stopped:
            return {**record, "status": "stopped at the deadline (resumable)"}
        if code != 0:
            text = log_path.read_text(errors="replace")
            lines = [ln for ln in text.splitlines() if ln.strip() and "it/s" not in ln]
            reason = "out of memory" if "OutOfMemoryError" in text else (lines[-1] if lines else "no output")
            return {**record, "status": f"failed (exit {code}): {reason[:300]}"}
        if job.phase == "throughput":
            return {**record, "status": "ok", "throughput": json.loads((run_dir / "throughput.json").read_text())}
        summary = summarize(run_dir)
        if (run_dir / "evaluation.json").exists():
            summary["evaluation"] = json.loads((run_dir / "evaluation.json").read_text())
        return {**record, "status": "ok", **summary}
