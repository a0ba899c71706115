"""What a run keeps on disk: checkpoints (atomic, verified on load), the run directory's lock, and the
metrics log (metrics.jsonl, strict JSON, mirrored to Weights & Biases)."""
from __future__ import annotations

import errno
import fcntl
import html
import json
import math
import os
import shutil
import stat
import tempfile
import zipfile
from dataclasses import asdict
from pathlib import Path

import torch
import wandb

from lab.config import TrainConfig, usage_error


def write_atomically(path: Path, write) -> None:
    """write(f) into a temp file that then replaces path: a crash mid-write leaves the previous file intact.

    The temp file lives in the same directory so os.replace is a rename on one filesystem; fsync before the
    rename (and of the directory after it) so the new name never points at unwritten data. A process killed
    mid-write leaves its temp file behind, which the next run in that directory removes (RunDir).
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # mkstemp makes the file 0600; the replacement keeps the mode of the file it replaces, or a new file's
        # (0666 less the umask), as an open() in its place would have.
        os.fchmod(fd, stat.S_IMODE(path.stat().st_mode) if path.exists() else 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _umask() -> int:
    mask = os.umask(0)  # the only way to read it is to set it
    os.umask(mask)
    return mask


class CheckpointWriteError(Exception):
    """A checkpoint could not be written (a full disk, say); the file it would have replaced is intact."""


def save_checkpoint(state: dict, path: Path) -> None:
    """torch.save(state) to path, atomically, or CheckpointWriteError saying why in words: on a full disk torch's
    zip writer fails with "[enforce fail at inline_container.cc] unexpected pos", which names no disk."""
    try:
        write_atomically(path, lambda f: torch.save(state, f))
    except (RuntimeError, OSError) as err:
        free = shutil.disk_usage(path.parent).free
        full = getattr(err, "errno", None) == errno.ENOSPC or free < _tensor_bytes(state)
        kept = f"{path} still holds the previous checkpoint" if path.exists() else "no checkpoint was written before"
        cause = (f"the disk holding {path.parent} is full ({free / 2**20:,.0f} MiB free)" if full
                 else f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}")
        raise CheckpointWriteError(f"could not write the checkpoint {path}: {cause}; {kept}") from err


def _tensor_bytes(obj) -> int:
    """The bytes of the tensors in a nest of dicts, lists and tuples: about what torch.save writes of it."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


CHECKPOINT_KEYS = {"model", "optimizer", "step", "config", "rng", "sampler", "world_size", "wandb_run_id", "data"}


def load_checkpoint(path: str | Path, arg: str = "--resume") -> dict:
    """The checkpoint at path, or a usage error naming the argument (arg), the file and what is wrong with it.

    torch.save writes a zip archive with a CRC-32 per member, which torch.load does not check: read every
    member once through zipfile first, so a flipped byte is caught rather than trained on.
    """
    what = f"{arg}: {path}"
    try:
        with zipfile.ZipFile(path) as archive:
            corrupt = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as err:
        usage_error(f"{what} is not a checkpoint written by train.py (not a torch archive: {err})")
    if corrupt is not None:
        usage_error(f"{what} is corrupt: its member {corrupt} fails its CRC-32 check; resume from another "
                    "checkpoint, or start the run afresh")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # noqa: BLE001 - unpickling fails in many ways; each is "unreadable" here
        usage_error(f"{what} cannot be read: {type(err).__name__}: {err}")
    missing = sorted(CHECKPOINT_KEYS - ckpt.keys()) if isinstance(ckpt, dict) else None
    if missing is None or missing or not isinstance(ckpt["config"], dict):
        usage_error(f"{what} is not a checkpoint written by this train.py "
                    + (f"(missing {', '.join(missing)})" if missing else "(expected a dict with a config dict)"))
    return ckpt


def resolve_wandb_mode(cfg: TrainConfig) -> str:
    """The wandb mode the run logs in: auto = online when logged in, else offline. Online without a login is a
    usage error, raised before the run writes anything (wandb.init would fail only after the data loaded)."""
    mode = cfg.wandb_mode if cfg.wandb_mode != "auto" else os.environ.get("WANDB_MODE") or "auto"
    if mode not in ("auto", "online"):
        return mode
    logged_in = wandb.login(prompt=False, verify=False)
    if mode == "auto":
        return "online" if logged_in else "offline"
    if not logged_in:
        usage_error("wandb_mode: 'online' needs a wandb login, and there is none here: run `wandb login` (or set "
                    "WANDB_API_KEY), or pass --wandb-mode offline (`wandb sync` uploads the run later)")
    return mode


def json_line(row: dict) -> str:
    """row as one line of strict JSON: inf and NaN (which json.dumps writes as bare tokens that strict parsers
    reject) become null."""
    def clean(value):
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, (list, tuple)):
            return [clean(v) for v in value]
        return value

    return json.dumps({k: clean(v) for k, v in row.items()}, allow_nan=False) + "\n"


class RunDir:
    """Rank 0's hold on out/<run_name>/: one train.py writes there at a time (an flock on .lock, released
    when the process ends however it ends), so what killed runs left behind can be removed safely."""

    def __init__(self, path: Path):
        path.mkdir(parents=True, exist_ok=True)
        self.lock = open(path / ".lock", "w")
        try:
            fcntl.flock(self.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.lock.close()
            usage_error(f"{path} is in use by another train.py (it holds {path / '.lock'}); wait for it to end, "
                        "or pass another --run_name")
        for stale in path.glob(".*.tmp"):  # temp files of writes a SIGKILL cut short (write_atomically)
            stale.unlink()

    def close(self) -> None:
        self.lock.close()


def kept_metrics(path: Path, start_step: int) -> str:
    """The lines of metrics.jsonl up to start_step, or a usage error naming the line that is not a metrics row.

    Rows past the checkpoint we resume from belong to a timeline that is being replaced, and a last line
    without its newline was cut short by a crash: both go.
    """
    kept = []
    for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True), 1):
        if not line.endswith("\n"):
            break
        try:
            step = json.loads(line)["step"]
            if not isinstance(step, int):
                raise TypeError
        except (ValueError, TypeError, KeyError):
            usage_error(f"{path}:{number}: not a metrics row (a JSON object with an int \"step\"): {line[:80]!r}; "
                        "mend or delete that line, then resume")
        if step <= start_step:
            kept.append(line)
    return "".join(kept)


class RunLog:
    """Rank 0's record of a run: metrics.jsonl in the run directory, and the same values in wandb."""

    def __init__(self, cfg: TrainConfig, run_dir: Path, run_id: str | None, start_step: int, wandb_mode: str):
        path = run_dir / "metrics.jsonl"
        if path.exists():
            kept = kept_metrics(path, start_step)
            write_atomically(path, lambda f: f.write(kept.encode()))
        self.wandb = wandb.init(project=cfg.wandb_project, name=cfg.run_name, group=cfg.wandb_group,
                                tags=[t for t in cfg.wandb_tags.split(",") if t], config=asdict(cfg),
                                mode=wandb_mode, id=run_id, resume="allow" if run_id else None)
        self.jsonl = open(path, "a")  # after wandb.init, which can fail, so that a failure leaks no file

    def log(self, step: int, metrics: dict, wandb_extra: dict | None = None) -> None:
        self.jsonl.write(json_line({"step": step, **metrics}))
        self.jsonl.flush()
        self.wandb.log({**metrics, **(wandb_extra or {})}, step=step)

    def log_eval(self, step: int, split: str, loss: float, curve=None, sample: str | None = None,
                 accuracy: float | None = None, attention: dict | None = None) -> None:
        """An evaluation's row: loss and bpc (over the scored bytes: recall's answers), and what was measured of
        them besides: the bpc-by-position curve, a sample, the accuracy, the attention's concentration
        (model.diagnostics' "attn/..." values, logged as split/attn/...)."""
        metrics, extra = {f"{split}/loss": loss, f"{split}/bpc": loss / math.log(2)}, {}
        metrics.update({f"{split}/{k}": v for k, v in (attention or {}).items()})
        if curve is not None:
            metrics[f"{split}/bpc_by_position"] = curve
            table = wandb.Table(columns=["position", "bpc"], data=[list(point) for point in curve])
            extra[f"{split}/bpc_by_position"] = wandb.plot.line(table, "position", "bpc",
                                                                title=f"{split} bpc by position, step {step}")
        if accuracy is not None:
            metrics[f"{split}/accuracy"] = accuracy
        if sample is not None:
            metrics[f"{split}/sample"] = sample
            extra[f"{split}/sample"] = wandb.Html(f"<pre>{html.escape(sample)}</pre>")
        self.log(step, metrics, extra)

    def close(self, exit_code: int) -> None:
        self.jsonl.close()
        self.wandb.finish(exit_code=exit_code)


def checkpoint_to_resume(resume: str | None, ckpt_path: Path, world_size: int) -> dict | None:
    """The checkpoint --resume names (None for a fresh run), checked for integrity and process count."""
    if resume == "auto":
        resume = str(ckpt_path) if ckpt_path.exists() else None
    elif resume is None and ckpt_path.exists():
        usage_error(f"{ckpt_path} exists: pass --resume auto to continue that run, "
                    "or --run_name NAME to start another")
    if resume is None:
        return None
    if not Path(resume).is_file():
        usage_error(f"--resume: no checkpoint at {resume}")
    ckpt = load_checkpoint(resume)
    if ckpt["world_size"] != world_size:
        usage_error(f"--resume: the checkpoint was written by a run of {ckpt['world_size']} process(es), this one has "
                    f"WORLD_SIZE={world_size}; each rank's data stream and dropout RNG continue only under the same "
                    "number of processes")
    return ckpt


def describe_data(fingerprint: dict, path: str | None) -> str:
    """A data fingerprint in words: enwik8's (data_fingerprint) or recall's (RecallTask.fingerprint)."""
    if fingerprint.get("task") == "recall":
        return (f"recall sequences (seq_len {fingerprint['seq_len']}, {fingerprint['pairs']} pairs, "
                f"{fingerprint['queries']} queries, seed {fingerprint['seed']}), "
                f"sha256 {fingerprint['sha256'][:16]}...")
    return (f"{path or 'enwik8 (verified download)'}: {fingerprint['bytes']:,} bytes, "
            f"sha256 {fingerprint['sha256'][:16]}...")


