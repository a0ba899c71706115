"""enwik8: download, verify, cache, read local copies, and split into train/val/test.

enwik8 is the first 10^8 bytes of an English Wikipedia XML dump; the model sees raw bytes (vocab 256).
The standard split is by byte offset: the first 90M bytes train, the next 5M validate, the last 5M test.
"""
from __future__ import annotations

import contextlib
import fcntl
import gzip
import hashlib
import http.client
import os
import shutil
import tempfile
import time
import urllib.error
import urllib.request
import zipfile
import zlib
from pathlib import Path
from typing import Iterator

import numpy as np
from tqdm import tqdm

ENWIK8_URL = "http://mattmahoney.net/dc/enwik8.zip"
ENWIK8_ZIP_SHA256 = "547994d9980ebed1288380d652999f38a14fe291a6247c157c3d33d4932534bc"
ENWIK8_MD5 = "a1fa5ffddb56f4953e226637dabbb36a"
ENWIK8_SIZE = 100_000_000
# Next to the package rather than relative to the working directory, so every entry point shares one cache.
DEFAULT_CACHE_DIR = Path(__file__).resolve().parent / "cache"
CHUNK_BYTES = 1 << 20
DOWNLOAD_TIMEOUT_S = 60          # per read: a connection that stalls
# The whole download: one that trickles never stalls. The zip is 36 MB, so this fails below about 20 kB/s,
# where fetching it by other means and passing --data-path is the better way anyway.
DOWNLOAD_DEADLINE_S = 30 * 60
LOCK_NAME = ".enwik8.lock"
WORKSPACE_PREFIX = ".enwik8-download-"
# What reading a damaged or unusual archive raises besides BadZipFile: zipfile raises RuntimeError for an
# encrypted member and NotImplementedError for a compression method it lacks, a cut or corrupt stream ends
# in EOFError or zlib.error, and OSError covers gzip.BadGzipFile and the file's own I/O errors.
ARCHIVE_ERRORS = (zipfile.BadZipFile, RuntimeError, NotImplementedError, EOFError, zlib.error, OSError)


class DataError(RuntimeError):
    """enwik8 could not be obtained or read; the message says what went wrong and how to fix it."""


def _file_digest(path: Path, algorithm: str) -> str:
    digest = hashlib.new(algorithm)
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _zip_member(zf: zipfile.ZipFile, name: str) -> str:
    """The member holding the data: "enwik8" if present, else the only file in the archive."""
    members = [m for m in zf.namelist() if not m.endswith("/")]
    if "enwik8" in members:
        return "enwik8"
    if len(members) == 1:
        return members[0]
    raise DataError(f"{name}: expected a zip with a member named 'enwik8' or a single file, found {members}")


def _fetch(url: str, dest: Path, sha256: str, timeout_s: float, deadline_s: float) -> None:
    """Stream url into dest, checking the byte count against Content-Length and the sha256.

    timeout_s bounds each read, deadline_s the whole download.
    """
    digest = hashlib.sha256()
    received = 0
    start = time.monotonic()
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp, open(dest, "wb") as out:
            # A malformed Content-Length counts as absent, as http.client itself treats it when reading the
            # body: the count only makes a truncation's message clearer, the sha256 guards the content.
            length = resp.headers.get("Content-Length", "")
            expected = int(length) if length.isdecimal() else None
            with tqdm(total=expected, unit="B", unit_scale=True, desc="enwik8.zip", disable=None) as bar:
                # read1 returns whatever has arrived, where read would wait for a whole chunk, so the
                # deadline is checked as a trickle comes in.
                while chunk := resp.read1(CHUNK_BYTES):
                    out.write(chunk)
                    digest.update(chunk)
                    received += len(chunk)
                    bar.update(len(chunk))
                    elapsed = time.monotonic() - start
                    if elapsed > deadline_s:
                        raise DataError(f"downloading {url} is too slow: {received:,} bytes arrived in "
                                        f"{elapsed:.1f} s, past the {deadline_s:g} s deadline")
    except urllib.error.HTTPError as err:
        raise DataError(f"downloading {url} failed: HTTP {err.code} {err.reason}") from err
    except (OSError, http.client.HTTPException) as err:
        raise DataError(f"downloading {url} failed: {err!r}") from err
    # http.client returns a short body without complaint when the server closes early, so count.
    if expected is not None and received != expected:
        raise DataError(f"download of {url} truncated: received {received:,} of the {expected:,} bytes "
                        "its Content-Length announced")
    if digest.hexdigest() != sha256:
        raise DataError(f"{url}: sha256 {digest.hexdigest()} does not match the expected {sha256} "
                        f"(truncated or corrupt download, received {received:,} bytes)")


def _decompress(path: Path, name: str) -> bytes:
    """The content of a .gz file, or of a zip's data member; name is how messages call the file."""
    try:
        if path.suffix.lower() == ".gz":
            with gzip.open(path) as f:
                return f.read()
        with zipfile.ZipFile(path) as zf:
            return zf.read(_zip_member(zf, name))
    except DataError:  # a RuntimeError too, but already says what is wrong
        raise
    except ARCHIVE_ERRORS as err:
        raise DataError(f"cannot read {name}: {err}") from err


def _extract_verified(zip_path: Path, dest: Path, md5: str, name: str) -> None:
    data = _decompress(zip_path, name)
    digest = hashlib.md5(data).hexdigest()
    if digest != md5:
        raise DataError(f"enwik8 extracted from {name}: md5 {digest} does not match the expected {md5}")
    dest.write_bytes(data)


def _read_raw(path: Path) -> np.ndarray:
    """The whole file, read into memory.

    Not np.memmap: a mapped file that shrinks while training runs kills the process with SIGBUS and no
    message. A copy per DDP rank is 100 MB, small beside the model and its optimizer state.
    """
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            data = np.frombuffer(f.read(), dtype=np.uint8)
    except OSError as err:
        raise DataError(f"cannot read {path}: {err}") from err
    if len(data) != size:
        raise DataError(f"{path}: read {len(data):,} bytes, expected its size {size:,}: "
                        "was it changed while being read?")
    return data


def _is_cached(target: Path, md5: str, hint: str) -> bool:
    """Whether target is the verified enwik8; False where nothing is there, DataError where else is."""
    if target.is_dir():
        raise DataError(f"the enwik8 cache path {target} is a directory: remove it, the verified file goes "
                        f"there. {hint}")
    if not target.exists():
        return False
    if _file_digest(target, "md5") != md5:
        raise DataError(f"cached {target} does not have md5 {md5}: delete it to download again. {hint}")
    return True


@contextlib.contextmanager
def _locked_workspace(cache_dir: Path, hint: str, log) -> Iterator[Path]:
    """A new temporary folder in cache_dir, yielded while holding an exclusive lock on the cache.

    The flock serialises downloads into one cache across processes, and the kernel drops it when its holder
    exits however it dies. So with it held no one is using an earlier workspace: those are left by killed
    downloads (SIGKILL skips the cleanup) and are removed here. The lock file stays, as deleting it would
    let a process still waiting on it and a newcomer lock two different files.
    """
    with contextlib.ExitStack() as stack:
        try:  # e.g. inside a read-only container image, where --data-path is the way
            cache_dir.mkdir(parents=True, exist_ok=True)
            lock = stack.enter_context(open(cache_dir / LOCK_NAME, "a"))
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log(f"enwik8: waiting for another process downloading into {cache_dir}")
                fcntl.flock(lock, fcntl.LOCK_EX)
            for stale in cache_dir.glob(WORKSPACE_PREFIX + "*"):
                shutil.rmtree(stale, ignore_errors=True)  # best effort: a leftover must not stop a download
            work = stack.enter_context(tempfile.TemporaryDirectory(dir=cache_dir, prefix=WORKSPACE_PREFIX))
        except OSError as err:
            raise DataError(f"cannot write the enwik8 cache in {cache_dir}: {err}. {hint}") from err
        yield Path(work)


def download_enwik8(cache_dir: str | Path = DEFAULT_CACHE_DIR, url: str = ENWIK8_URL,
                    zip_sha256: str = ENWIK8_ZIP_SHA256, md5: str = ENWIK8_MD5, log=print,
                    timeout_s: float = DOWNLOAD_TIMEOUT_S, deadline_s: float = DOWNLOAD_DEADLINE_S) -> Path:
    """Path of the verified raw enwik8 in cache_dir, downloading it on first use.

    The work happens in a temporary folder inside cache_dir that is removed however the attempt ends, and
    the file takes its final name (atomic os.replace, same filesystem) only after both checksums pass, so a
    failed or interrupted download never leaves a partial file or poisons the cache. Downloads into one
    cache take turns (see _locked_workspace): one that waited finds the file cached.
    timeout_s bounds each read from the server, deadline_s the whole download.
    """
    cache_dir = Path(cache_dir)
    target = cache_dir / "enwik8"
    hint = (f"To fix: retry, or fetch {url} yourself and pass --data-path to the local copy "
            "(a raw enwik8 file, a .zip or a .gz).")
    # Checked before locking, which needs write access, so a read-only cache that holds enwik8 works.
    if _is_cached(target, md5, hint):
        log(f"enwik8: using cached {target}")
        return target
    with _locked_workspace(cache_dir, hint, log) as work:
        if _is_cached(target, md5, hint):
            log(f"enwik8: using {target}, cached meanwhile by another process")
            return target
        log(f"enwik8: downloading {url} into {cache_dir}")
        zip_path, raw_path = work / "enwik8.zip", work / "enwik8"
        try:
            _fetch(url, zip_path, zip_sha256, timeout_s, deadline_s)
            _extract_verified(zip_path, raw_path, md5, name=url)
        except DataError as err:
            raise DataError(f"{err}. {hint}") from err
        os.replace(raw_path, target)
    log(f"enwik8: verified (sha256 of the zip, md5 of enwik8) and cached at {target}")
    return target


def read_local(path: str | Path, log=print) -> np.ndarray:
    """A local raw file, .zip or .gz as a uint8 array; not checksum-verified, as partial copies are fine."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data_path: {path} does not exist or is not a file")
    if path.stat().st_size == 0:
        raise DataError(f"data_path: {path} is empty")
    if path.suffix.lower() in (".zip", ".gz"):  # enwik8.ZIP is a zip all the same
        data = np.frombuffer(_decompress(path, str(path)), dtype=np.uint8)
    else:
        data = _read_raw(path)
    log(f"enwik8: {path}: {len(data):,} bytes (local file, not checksum-verified)")
    return data


def split_sizes(n: int) -> tuple[int, int, int]:
    """(train, val, test) byte counts, 90/5/5 in integer arithmetic: exactly 90M/5M/5M for the full enwik8."""
    if n < 3:
        raise ValueError(f"n: expected at least 3 bytes (one per split), got {n}")
    n_val = max(1, n * 5 // 100)
    return n - 2 * n_val, n_val, n_val


def split_enwik8(data: np.ndarray, log=print, name: str = "data") -> dict[str, np.ndarray]:
    """Contiguous train/val/test views of data, in that order, covering it exactly; name is data's file."""
    try:
        n_train, n_val, _ = split_sizes(len(data))
    except ValueError as err:
        raise DataError(f"{name}: {len(data):,} bytes are too few to split into train/val/test, "
                        "which need at least one byte each") from err
    if len(data) != ENWIK8_SIZE:
        log(f"enwik8: {len(data):,} bytes is not the full {ENWIK8_SIZE:,}: "
            "splitting 90/5/5 proportionally (integer arithmetic)")
    splits = {"train": data[:n_train], "val": data[n_train:n_train + n_val], "test": data[n_train + n_val:]}
    log("enwik8 splits: " + ", ".join(f"{name} {len(split):,} bytes" for name, split in splits.items()))
    return splits


def data_fingerprint(splits: dict[str, np.ndarray]) -> dict:
    """{"bytes", "sha256"} of the data behind splits, for a checkpoint to refuse a resume on other data.

    split_enwik8's splits are contiguous views covering the data in train/val/test order, so this is the
    sha256 of the file's (decompressed) content.
    """
    parts = [splits[name] for name in ("train", "val", "test")]
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part)
    return {"bytes": sum(len(part) for part in parts), "sha256": digest.hexdigest()}


def load_enwik8(data_path: str | Path | None = None, cache_dir: str | Path = DEFAULT_CACHE_DIR,
                url: str = ENWIK8_URL, log=print, zip_sha256: str = ENWIK8_ZIP_SHA256,
                md5: str = ENWIK8_MD5, timeout_s: float = DOWNLOAD_TIMEOUT_S,
                deadline_s: float = DOWNLOAD_DEADLINE_S) -> dict[str, np.ndarray]:
    """{"train", "val", "test"} uint8 arrays from data_path when given, else from the verified download.

    Under DDP call it on rank 0 first (then barrier) so the ranks do not all download at once.
    """
    if data_path is not None:
        path, data = Path(data_path), read_local(data_path, log)
    else:
        path = download_enwik8(cache_dir, url, zip_sha256, md5, log, timeout_s, deadline_s)
        data = _read_raw(path)
    return split_enwik8(data, log, name=str(path))
