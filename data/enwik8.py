"""enwik8: download, verify, cache, read local copies, and split into train/val/test.

enwik8 is the first 10^8 bytes of an English Wikipedia XML dump; the model sees raw bytes (vocab 256).
The standard split is by byte offset: the first 90M bytes train, the next 5M validate, the last 5M test.
"""
from __future__ import annotations

import gzip
import hashlib
import http.client
import os
import tempfile
import urllib.error
import urllib.request
import zipfile
import zlib
from pathlib import Path

import numpy as np
from tqdm import tqdm

ENWIK8_URL = "http://mattmahoney.net/dc/enwik8.zip"
ENWIK8_ZIP_SHA256 = "547994d9980ebed1288380d652999f38a14fe291a6247c157c3d33d4932534bc"
ENWIK8_MD5 = "a1fa5ffddb56f4953e226637dabbb36a"
ENWIK8_SIZE = 100_000_000
# Next to the package rather than relative to the working directory, so every entry point shares one cache.
DEFAULT_CACHE_DIR = Path(__file__).resolve().parent / "cache"
CHUNK_BYTES = 1 << 20
DOWNLOAD_TIMEOUT_S = 60


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


def _fetch(url: str, dest: Path, sha256: str) -> None:
    """Stream url into dest, checking the byte count against Content-Length and the sha256."""
    digest = hashlib.sha256()
    received = 0
    try:
        with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as resp, open(dest, "wb") as out:
            length = resp.headers.get("Content-Length")
            expected = int(length) if length is not None else None
            with tqdm(total=expected, unit="B", unit_scale=True, desc="enwik8.zip", disable=None) as bar:
                while chunk := resp.read(CHUNK_BYTES):
                    out.write(chunk)
                    digest.update(chunk)
                    received += len(chunk)
                    bar.update(len(chunk))
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


def _extract_verified(zip_path: Path, dest: Path, md5: str, name: str) -> None:
    digest = hashlib.md5()
    try:
        with zipfile.ZipFile(zip_path) as zf, zf.open(_zip_member(zf, name)) as src, open(dest, "wb") as out:
            while chunk := src.read(CHUNK_BYTES):
                out.write(chunk)
                digest.update(chunk)
    except zipfile.BadZipFile as err:
        raise DataError(f"{name} is not a valid zip file: {err}") from err
    if digest.hexdigest() != md5:
        raise DataError(f"enwik8 extracted from {name}: md5 {digest.hexdigest()} does not match "
                        f"the expected {md5}")


def download_enwik8(cache_dir: str | Path = DEFAULT_CACHE_DIR, url: str = ENWIK8_URL,
                    zip_sha256: str = ENWIK8_ZIP_SHA256, md5: str = ENWIK8_MD5, log=print) -> Path:
    """Path of the verified raw enwik8 in cache_dir, downloading it on first use.

    The work happens in a temporary folder inside cache_dir that is removed however the attempt ends, and
    the file takes its final name (atomic os.replace, same filesystem) only after both checksums pass, so a
    failed or interrupted download never leaves a partial file or poisons the cache.
    """
    cache_dir = Path(cache_dir)
    target = cache_dir / "enwik8"
    hint = (f"To fix: retry, or fetch {url} yourself and pass --data-path to the local copy "
            "(a raw enwik8 file, a .zip or a .gz).")
    if target.exists():
        if _file_digest(target, "md5") != md5:
            raise DataError(f"cached {target} does not have md5 {md5}: delete it to download again. {hint}")
        log(f"enwik8: using cached {target}")
        return target
    log(f"enwik8: downloading {url} into {cache_dir}")
    try:  # e.g. inside a read-only container image, where --data-path is the way
        cache_dir.mkdir(parents=True, exist_ok=True)
        workspace = tempfile.TemporaryDirectory(dir=cache_dir, prefix=".enwik8-download-")
    except OSError as err:
        raise DataError(f"cannot write the enwik8 cache in {cache_dir}: {err}. {hint}") from err
    with workspace as work:
        zip_path, raw_path = Path(work) / "enwik8.zip", Path(work) / "enwik8"
        try:
            _fetch(url, zip_path, zip_sha256)
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
    try:
        if path.suffix == ".zip":
            with zipfile.ZipFile(path) as zf:
                data = np.frombuffer(zf.read(_zip_member(zf, str(path))), dtype=np.uint8)
        elif path.suffix == ".gz":
            with gzip.open(path) as f:
                data = np.frombuffer(f.read(), dtype=np.uint8)
        else:
            # A memmap lets DDP ranks on one node share the page cache instead of each holding a copy.
            data = np.memmap(path, dtype=np.uint8, mode="r")
    except (zipfile.BadZipFile, gzip.BadGzipFile, EOFError, zlib.error) as err:
        raise DataError(f"data_path: cannot read {path}: {err}") from err
    log(f"enwik8: {path}: {len(data):,} bytes (local file, not checksum-verified)")
    return data


def split_sizes(n: int) -> tuple[int, int, int]:
    """(train, val, test) byte counts, 90/5/5 in integer arithmetic: exactly 90M/5M/5M for the full enwik8."""
    if n < 3:
        raise ValueError(f"n: expected at least 3 bytes (one per split), got {n}")
    n_val = max(1, n * 5 // 100)
    return n - 2 * n_val, n_val, n_val


def split_enwik8(data: np.ndarray, log=print) -> dict[str, np.ndarray]:
    """Contiguous train/val/test views of data, in that order, covering it exactly."""
    n_train, n_val, _ = split_sizes(len(data))
    if len(data) != ENWIK8_SIZE:
        log(f"enwik8: {len(data):,} bytes is not the full {ENWIK8_SIZE:,}: "
            "splitting 90/5/5 proportionally (integer arithmetic)")
    splits = {"train": data[:n_train], "val": data[n_train:n_train + n_val], "test": data[n_train + n_val:]}
    log("enwik8 splits: " + ", ".join(f"{name} {len(split):,} bytes" for name, split in splits.items()))
    return splits


def load_enwik8(data_path: str | Path | None = None, cache_dir: str | Path = DEFAULT_CACHE_DIR,
                url: str = ENWIK8_URL, log=print, zip_sha256: str = ENWIK8_ZIP_SHA256,
                md5: str = ENWIK8_MD5) -> dict[str, np.ndarray]:
    """{"train", "val", "test"} uint8 arrays from data_path when given, else from the verified download.

    Under DDP call it on rank 0 first (then barrier) so the ranks do not all download at once.
    """
    if data_path is not None:
        data = read_local(data_path, log)
    else:
        data = np.memmap(download_enwik8(cache_dir, url, zip_sha256, md5, log), dtype=np.uint8, mode="r")
    return split_enwik8(data, log)
