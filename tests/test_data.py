import gzip
import hashlib
import http.server
import io
import threading
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from data import (DataError, RandomWindowSampler, data_fingerprint, download_enwik8, eval_windows, load_enwik8,
                  num_eval_targets, read_local, split_enwik8, split_sizes)
from data.__main__ import main as data_cli
from data.enwik8 import LOCK_NAME, WORKSPACE_PREFIX, _read_raw

SHARED_4MB = Path(__file__).resolve().parents[2] / "shared" / "data" / "enwik8-first4mb"
PAYLOAD = np.random.default_rng(0).integers(0, 256, size=5000, dtype=np.uint8).tobytes()


def zip_bytes(members: dict[str, bytes], flag_bits: int = 0, compress_type: int = zipfile.ZIP_DEFLATED) -> bytes:
    """A zip of members; flag_bits and compress_type forge what the central directory says of each."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, content in members.items():
            zf.writestr(name, content)
        for info in zf.infolist():  # written to the central directory on close, which is what readers trust
            info.flag_bits |= flag_bits
            info.compress_type = compress_type
    return buf.getvalue()


def trickle(body: bytes, pieces: int, pause_s: float):
    """body in that many pieces, each sent after a pause: a slow or stalling server."""
    step = -(-len(body) // pieces)
    for start in range(0, len(body), step):
        time.sleep(pause_s)
        yield body[start:start + step]


def cache_files(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir())


GOOD_ZIP = zip_bytes({"enwik8": PAYLOAD})
NOT_A_ZIP = b"not a zip"
GOOD_SUMS = {"zip_sha256": hashlib.sha256(GOOD_ZIP).hexdigest(), "md5": hashlib.md5(PAYLOAD).hexdigest()}


@pytest.fixture
def server():
    """A local HTTP server: routes maps a path to (body, Content-Length or None), the body bytes or an iterable
    of pieces to send one by one; requests logs every GET."""
    routes, requests = {}, []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            requests.append(self.path)
            if self.path not in routes:
                self.send_error(404)
                return
            body, length = routes[self.path]
            self.send_response(200)
            if length is not None:
                self.send_header("Content-Length", str(length))
            self.end_headers()
            try:
                for piece in [body] if isinstance(body, bytes) else body:
                    self.wfile.write(piece)
            except ConnectionError:  # the client gave up, as the deadline and timeout tests make it
                pass

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_port}", routes, requests
    httpd.shutdown()
    httpd.server_close()
    thread.join()


# A malformed Content-Length counts as absent: the sha256 still guards the content.
@pytest.mark.parametrize("length", [len(GOOD_ZIP), None, "many", "-1"],
                         ids=["length", "no-length", "malformed-length", "negative-length"])
def test_download_verifies_caches_and_does_not_fetch_again(server, tmp_path, length):
    base, routes, requests = server
    routes["/enwik8.zip"] = (GOOD_ZIP, length)
    cache = tmp_path / "cache"
    n_train, n_val, n_test = split_sizes(len(PAYLOAD))
    for _ in range(2):
        splits = load_enwik8(cache_dir=cache, url=base + "/enwik8.zip", log=lambda msg: None, **GOOD_SUMS)
        assert b"".join(split.tobytes() for split in splits.values()) == PAYLOAD
        assert [len(split) for split in splits.values()] == [n_train, n_val, n_test]
    assert requests == ["/enwik8.zip"]
    assert cache_files(cache) == [LOCK_NAME, "enwik8"]


def test_corrupted_cache_is_reported_not_used(server, tmp_path):
    base, routes, _ = server
    routes["/enwik8.zip"] = (GOOD_ZIP, len(GOOD_ZIP))
    cache = tmp_path / "cache"
    load_enwik8(cache_dir=cache, url=base + "/enwik8.zip", log=lambda msg: None, **GOOD_SUMS)
    (cache / "enwik8").write_bytes(PAYLOAD[:-1])
    with pytest.raises(DataError, match="delete it"):
        load_enwik8(cache_dir=cache, url=base + "/enwik8.zip", log=lambda msg: None, **GOOD_SUMS)


@pytest.mark.parametrize("body, length, sums, message", [
    (GOOD_ZIP[:-100], len(GOOD_ZIP), GOOD_SUMS, "truncated: received"),    # server closes early
    (GOOD_ZIP[:-100], None, GOOD_SUMS, "sha256"),                           # no Content-Length: the checksum
    (GOOD_ZIP[:-100], "100 MB", GOOD_SUMS, "sha256"),                       # malformed: as if absent
    (GOOD_ZIP, len(GOOD_ZIP), {**GOOD_SUMS, "zip_sha256": "0" * 64}, "sha256"),
    (GOOD_ZIP, len(GOOD_ZIP), {**GOOD_SUMS, "md5": "0" * 32}, "md5"),
    (NOT_A_ZIP, len(NOT_A_ZIP), {**GOOD_SUMS, "zip_sha256": hashlib.sha256(NOT_A_ZIP).hexdigest()},
     "cannot read .* not a zip file"),
], ids=["short-body", "short-body-no-length", "short-body-malformed-length", "wrong-sha256", "wrong-md5",
        "not-a-zip"])
def test_bad_download_raises_and_leaves_nothing(server, tmp_path, body, length, sums, message):
    base, routes, _ = server
    routes["/enwik8.zip"] = (body, length)
    cache = tmp_path / "cache"
    with pytest.raises(DataError, match=message) as err:
        load_enwik8(cache_dir=cache, url=base + "/enwik8.zip", log=lambda msg: None, **sums)
    assert "--data-path" in str(err.value)
    assert cache_files(cache) == [LOCK_NAME]


def test_unwritable_cache_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")  # a file where the cache's parent folder should be: no user can create it
    with pytest.raises(DataError, match=r"cannot write the enwik8 cache in .*file/cache: .*pass --data-path"):
        load_enwik8(cache_dir=blocker / "cache", url="http://127.0.0.1:9/enwik8.zip", log=lambda msg: None)


def test_http_error_is_clear(server, tmp_path):
    base, _, _ = server
    with pytest.raises(DataError, match="HTTP 404") as err:
        load_enwik8(cache_dir=tmp_path / "cache", url=base + "/missing.zip", log=lambda msg: None)
    assert base + "/missing.zip" in str(err.value) and "--data-path" in str(err.value)
    assert cache_files(tmp_path / "cache") == [LOCK_NAME]


def test_trickling_download_stops_at_the_deadline(server, tmp_path):
    base, routes, _ = server
    routes["/enwik8.zip"] = (trickle(GOOD_ZIP, pieces=len(GOOD_ZIP), pause_s=0.01), len(GOOD_ZIP))  # ~50 s
    start = time.monotonic()
    with pytest.raises(DataError, match=r"too slow: [\d,]+ bytes arrived in [\d.]+ s, past the 0.5 s deadline") as err:
        load_enwik8(cache_dir=tmp_path / "cache", url=base + "/enwik8.zip", log=lambda msg: None,
                    timeout_s=10, deadline_s=0.5, **GOOD_SUMS)
    assert time.monotonic() - start < 5   # each byte arrives well within the per-read timeout
    assert "--data-path" in str(err.value)
    assert cache_files(tmp_path / "cache") == [LOCK_NAME]


def test_stalled_download_times_out(server, tmp_path):
    base, routes, _ = server
    routes["/enwik8.zip"] = (trickle(GOOD_ZIP, pieces=2, pause_s=3), len(GOOD_ZIP))
    with pytest.raises(DataError, match="timed out") as err:
        load_enwik8(cache_dir=tmp_path / "cache", url=base + "/enwik8.zip", log=lambda msg: None,
                    timeout_s=0.3, **GOOD_SUMS)
    assert "--data-path" in str(err.value)


def test_directory_at_the_cache_path_is_a_clear_error(server, tmp_path):
    base, routes, requests = server
    routes["/enwik8.zip"] = (GOOD_ZIP, len(GOOD_ZIP))
    (tmp_path / "cache" / "enwik8").mkdir(parents=True)
    with pytest.raises(DataError, match=f"{tmp_path / 'cache' / 'enwik8'} is a directory: remove it"):
        load_enwik8(cache_dir=tmp_path / "cache", url=base + "/enwik8.zip", log=lambda msg: None, **GOOD_SUMS)
    assert requests == []


def test_download_removes_workspaces_of_killed_downloads(server, tmp_path):
    base, routes, _ = server
    routes["/enwik8.zip"] = (GOOD_ZIP, len(GOOD_ZIP))
    stale = tmp_path / "cache" / (WORKSPACE_PREFIX + "killed")   # as a SIGKILLed download leaves it
    stale.mkdir(parents=True)
    (stale / "enwik8.zip").write_bytes(GOOD_ZIP[:100])
    load_enwik8(cache_dir=tmp_path / "cache", url=base + "/enwik8.zip", log=lambda msg: None, **GOOD_SUMS)
    assert cache_files(tmp_path / "cache") == [LOCK_NAME, "enwik8"]


def test_concurrent_downloads_take_turns(server, tmp_path):
    base, routes, requests = server
    routes["/enwik8.zip"] = (trickle(GOOD_ZIP, pieces=5, pause_s=0.2), len(GOOD_ZIP))
    args = {"cache_dir": tmp_path / "cache", "url": base + "/enwik8.zip", **GOOD_SUMS}
    first = []
    thread = threading.Thread(target=lambda: first.append(download_enwik8(**args, log=lambda msg: None)))
    thread.start()
    deadline = time.monotonic() + 10
    while not requests and time.monotonic() < deadline:   # the first download holds the lock once it asks
        time.sleep(0.01)
    logged = []
    second = download_enwik8(**args, log=logged.append)
    thread.join()
    assert requests == ["/enwik8.zip"]
    assert first == [second] == [tmp_path / "cache" / "enwik8"]
    assert "waiting for another process" in logged[0] and "cached meanwhile by another process" in logged[-1]


def test_verified_cache_is_used_without_locking(tmp_path):
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "enwik8").write_bytes(PAYLOAD)   # as in a read-only container image
    splits = load_enwik8(cache_dir=tmp_path / "cache", url="http://127.0.0.1:9/enwik8.zip",
                         log=lambda msg: None, **GOOD_SUMS)
    assert b"".join(split.tobytes() for split in splits.values()) == PAYLOAD
    assert cache_files(tmp_path / "cache") == ["enwik8"]


@pytest.mark.parametrize("name, content", [
    ("enwik8", PAYLOAD),
    ("enwik8.zip", GOOD_ZIP),
    ("other.zip", zip_bytes({"readme.txt": b"x", "enwik8": PAYLOAD})),
    ("single.zip", zip_bytes({"some-name": PAYLOAD})),
    ("enwik8.gz", gzip.compress(PAYLOAD)),
    ("enwik8.ZIP", GOOD_ZIP),
    ("enwik8.GZ", gzip.compress(PAYLOAD)),
    ("enwik8.Gz", gzip.compress(PAYLOAD)),
], ids=["raw", "zip", "zip-named-member", "zip-single-member", "gz", "ZIP", "GZ", "Gz"])
def test_local_files(tmp_path, name, content):
    (tmp_path / name).write_bytes(content)
    logged = []
    data = read_local(tmp_path / name, log=logged.append)
    assert data.dtype == np.uint8 and data.tobytes() == PAYLOAD
    assert f"{len(PAYLOAD):,} bytes" in logged[0] and "not checksum-verified" in logged[0]


@pytest.mark.parametrize("name, content, message", [
    ("two.zip", zip_bytes({"a": b"1", "b": b"2"}), "'enwik8' or a single file"),
    ("bad.zip", b"not a zip", "cannot read"),
    ("bad.gz", b"not gzip", "cannot read"),
    ("cut.gz", gzip.compress(PAYLOAD)[:-20], "cannot read"),
    ("empty", b"", "is empty"),
    ("locked.zip", zip_bytes({"enwik8": PAYLOAD}, flag_bits=0x1), "cannot read .*password required"),
    ("ppmd.zip", zip_bytes({"enwik8": PAYLOAD}, compress_type=98), "cannot read .*compression method"),
    ("corrupt.zip", GOOD_ZIP[:100] + bytes(10) + GOOD_ZIP[110:], "cannot read"),
    ("cut.GZ", gzip.compress(PAYLOAD)[:-20], "cannot read"),
], ids=["zip-ambiguous", "bad-zip", "bad-gz", "truncated-gz", "empty", "encrypted-zip", "unsupported-compression",
        "corrupt-zip-member", "truncated-GZ"])
def test_bad_local_files(tmp_path, name, content, message):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(DataError, match=message) as err:
        read_local(tmp_path / name, log=lambda msg: None)
    assert str(tmp_path / name) in str(err.value)


@pytest.mark.parametrize("name, content, n", [
    ("one", b"x", 1),
    ("two", b"xy", 2),
    ("two.gz", gzip.compress(b"xy"), 2),
    ("one.zip", zip_bytes({"enwik8": b"x"}), 1),
], ids=["raw-1", "raw-2", "gz-2", "zip-1"])
def test_too_small_to_split_names_the_file(tmp_path, name, content, n):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(DataError, match=f"{tmp_path / name}: {n} bytes are too few to split"):
        load_enwik8(data_path=tmp_path / name, log=lambda msg: None)


@pytest.mark.parametrize("source", ["local", "cached-download"])
def test_raw_data_survives_the_file_being_truncated(server, tmp_path, source):
    """A memmap would die of SIGBUS reading the data after this; a copy in memory does not care."""
    base, routes, _ = server
    routes["/enwik8.zip"] = (GOOD_ZIP, len(GOOD_ZIP))
    (tmp_path / "raw").write_bytes(PAYLOAD)
    splits = load_enwik8(data_path=tmp_path / "raw" if source == "local" else None, cache_dir=tmp_path / "cache",
                         url=base + "/enwik8.zip", log=lambda msg: None, **GOOD_SUMS)
    assert not any(isinstance(split, np.memmap) for split in splits.values())
    for path in (tmp_path / "raw", tmp_path / "cache" / "enwik8"):
        if path.exists():
            path.write_bytes(b"")
    assert b"".join(split.tobytes() for split in splits.values()) == PAYLOAD


@pytest.mark.skipif(not Path("/proc/version").is_file(), reason="needs procfs")
def test_raw_read_checks_the_size():
    # procfs files stat as 0 bytes yet read as more: the same mismatch as a file changed while being read.
    with pytest.raises(DataError, match=r"/proc/version: read [\d,]+ bytes, expected its size 0"):
        _read_raw(Path("/proc/version"))


def test_missing_local_file_names_the_path(tmp_path):
    with pytest.raises(DataError, match=f"data_path: {tmp_path / 'nope'} does not exist"):
        load_enwik8(data_path=tmp_path / "nope", log=lambda msg: None)


def test_data_fingerprint_is_the_sha256_of_the_content(tmp_path):
    changed = bytearray(PAYLOAD)
    changed[len(PAYLOAD) // 2] ^= 1
    fingerprints = {}
    for name, content in [("raw", PAYLOAD), ("same.gz", gzip.compress(PAYLOAD)), ("changed", bytes(changed))]:
        (tmp_path / name).write_bytes(content)
        fingerprints[name] = data_fingerprint(load_enwik8(data_path=tmp_path / name, log=lambda msg: None))
    assert fingerprints["raw"] == {"bytes": len(PAYLOAD), "sha256": hashlib.sha256(PAYLOAD).hexdigest()}
    assert fingerprints["same.gz"] == fingerprints["raw"]     # the content, however it is stored
    assert fingerprints["changed"]["sha256"] != fingerprints["raw"]["sha256"]


def test_split_sizes():
    assert split_sizes(100_000_000) == (90_000_000, 5_000_000, 5_000_000)
    assert split_sizes(4_154_064) == (3_738_658, 207_703, 207_703)
    assert split_sizes(1001) == (901, 50, 50)
    assert split_sizes(3) == (1, 1, 1)
    with pytest.raises(ValueError, match="at least 3 bytes"):
        split_sizes(2)


@pytest.mark.parametrize("n", [3, 57, 1001, 20_000])
def test_splits_are_contiguous_and_cover_the_file(n):
    data = np.arange(n, dtype=np.int64).astype(np.uint8)
    logged = []
    splits = split_enwik8(data, log=logged.append)
    assert list(splits) == ["train", "val", "test"]
    assert tuple(len(s) for s in splits.values()) == split_sizes(n)
    assert np.array_equal(np.concatenate(list(splits.values())), data)
    assert "proportionally" in logged[0]


def three_splits(n=3000):
    """A file whose train, val and test bytes are 1, 2 and 3, so any window crossing a boundary shows."""
    n_train, n_val, n_test = split_sizes(n)
    data = np.repeat(np.array([1, 2, 3], dtype=np.uint8), [n_train, n_val, n_test])
    return split_enwik8(data, log=lambda msg: None)


def test_sampler_stays_in_its_split():
    for value, split in enumerate(three_splits().values(), start=1):
        sampler = RandomWindowSampler(split, batch_size=64, seq_len=len(split) // 2, seed=0)
        for _ in range(5):
            x, y = sampler.next_batch()
            assert (x == value).all() and (y == value).all()


def test_sampler_windows_shift_and_reach_both_ends():
    data = np.arange(200, dtype=np.uint8)   # byte value == offset, so x[:, 0] is the window start
    sampler = RandomWindowSampler(data, batch_size=4096, seq_len=16, seed=3)
    x, y = sampler.next_batch()
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (4096, 16)
    assert torch.equal(y, x + 1)
    assert x[:, 0].min() == 0 and y[:, -1].max() == 199


def test_sampler_resume_is_bit_exact():
    data = np.random.default_rng(1).integers(0, 256, size=10_000, dtype=np.uint8)
    uninterrupted = RandomWindowSampler(data, batch_size=8, seq_len=32, seed=7)
    batches = [uninterrupted.next_batch() for _ in range(6)]

    interrupted = RandomWindowSampler(data, batch_size=8, seq_len=32, seed=7)
    for _ in range(3):
        interrupted.next_batch()
    buf = io.BytesIO()
    torch.save(interrupted.state_dict(), buf)
    buf.seek(0)
    resumed = RandomWindowSampler(data, batch_size=8, seq_len=32, seed=7)
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    for expected in batches[3:]:
        assert all(torch.equal(a, b) for a, b in zip(resumed.next_batch(), expected))

    with pytest.raises(ValueError, match="seed"):
        RandomWindowSampler(data, batch_size=8, seq_len=32, seed=8).load_state_dict(interrupted.state_dict())


def test_sampler_ranks_draw_different_streams():
    data = np.random.default_rng(1).integers(0, 256, size=10_000, dtype=np.uint8)
    x0, _ = RandomWindowSampler(data, 8, 32, seed=7, rank=0, world_size=2).next_batch()
    x0_again, _ = RandomWindowSampler(data, 8, 32, seed=7, rank=0, world_size=2).next_batch()
    x1, _ = RandomWindowSampler(data, 8, 32, seed=7, rank=1, world_size=2).next_batch()
    assert torch.equal(x0, x0_again) and not torch.equal(x0, x1)


@pytest.mark.parametrize("kwargs, message", [
    ({"seq_len": 100}, r"seq_len=100 needs windows of seq_len \+ 1 = 101 bytes, but the split has only 100"),
    ({"seq_len": 0}, "seq_len: expected a positive int"),
    ({"batch_size": 0}, "batch_size: expected a positive int"),
    ({"seed": -1}, "seed: expected a non-negative int"),
    ({"rank": 2, "world_size": 2}, r"rank: expected an int in \[0, world_size=2\)"),
    ({"data": np.zeros(100, dtype=np.int64)}, "data: expected a 1-D uint8 numpy array"),
    ({"data": torch.zeros(100, dtype=torch.uint8)}, "data: expected a 1-D uint8 numpy array"),
])
def test_sampler_rejects_bad_arguments(kwargs, message):
    args = {"data": np.zeros(100, dtype=np.uint8), "batch_size": 4, "seq_len": 8, "seed": 0, **kwargs}
    with pytest.raises(ValueError, match=message):
        RandomWindowSampler(**args)


def scored_counts(data, seq_len, batch_size, max_windows=None):
    """How many times each byte of data is scored as a target, checking x and y against data on the way."""
    counts = np.zeros(len(data), dtype=np.int64)
    n_windows = 0
    for x, y, mask in eval_windows(data, seq_len, batch_size, max_windows):
        assert x.dtype == y.dtype == torch.int64 and mask.dtype == torch.bool
        assert x.shape == y.shape == mask.shape and x.shape[0] <= batch_size
        for xi, yi, mi in zip(x.numpy(), y.numpy(), mask.numpy()):
            start = int(xi[0])   # byte value == offset
            assert np.array_equal(xi, data[start:start + seq_len])
            assert np.array_equal(yi, data[start + 1:start + seq_len + 1])
            counts[start + 1:start + seq_len + 1] += mi
            n_windows += 1
    return counts, n_windows


@pytest.mark.parametrize("n, seq_len", [(200, 16), (193, 16), (17, 16), (200, 1), (200, 199)])
def test_eval_windows_score_every_target_once(n, seq_len):
    data = np.arange(n, dtype=np.uint8)
    counts, n_windows = scored_counts(data, seq_len, batch_size=3)
    assert counts[0] == 0 and (counts[1:] == 1).all()
    assert n_windows == -(-(n - 1) // seq_len)
    assert num_eval_targets(data, seq_len) == n - 1


@pytest.mark.parametrize("max_windows", [1, 2, 5, 12])
def test_eval_windows_max_windows(max_windows):
    data = np.arange(200, dtype=np.uint8)
    counts, n_windows = scored_counts(data, seq_len=16, batch_size=4, max_windows=max_windows)
    assert n_windows == max_windows and counts.max() == 1
    assert counts.sum() == max_windows * 16 == num_eval_targets(data, 16, max_windows)
    assert counts[1] == 1 and (max_windows == 1 or counts[-1] == 1)   # spread from start to end


def test_eval_windows_max_windows_at_least_the_full_count_covers_everything():
    data = np.arange(200, dtype=np.uint8)
    counts, n_windows = scored_counts(data, seq_len=16, batch_size=4, max_windows=100)
    assert n_windows == 13 and (counts[1:] == 1).all()


def test_eval_windows_are_deterministic():
    data = np.random.default_rng(2).integers(0, 256, size=5000, dtype=np.uint8)
    for max_windows in (None, 7):
        first, second = (list(eval_windows(data, 64, 5, max_windows)) for _ in range(2))
        assert len(first) == len(second)
        assert all(torch.equal(a, b) for pair in zip(first, second) for a, b in zip(*pair))


@pytest.mark.parametrize("kwargs, message", [
    ({"seq_len": 100}, r"seq_len=100 .* only 100 bytes"),
    ({"batch_size": 0}, "batch_size: expected a positive int"),
    ({"max_windows": 0}, "max_windows: expected a positive int"),
])
def test_eval_windows_reject_bad_arguments(kwargs, message):
    args = {"data": np.zeros(100, dtype=np.uint8), "seq_len": 8, "batch_size": 4, **kwargs}
    with pytest.raises(ValueError, match=message):
        eval_windows(**args)


@pytest.mark.skipif(not SHARED_4MB.exists(), reason="needs ../shared/data/enwik8-first4mb")
def test_first_4mb_of_enwik8(capsys):
    data_cli(["--data-path", str(SHARED_4MB)])
    out = capsys.readouterr().out
    assert "4,154,064 bytes" in out and "proportionally" in out
    splits = load_enwik8(data_path=SHARED_4MB, log=lambda msg: None)
    assert [len(s) for s in splits.values()] == [3_738_658, 207_703, 207_703]
    assert splits["train"][:10].tobytes() == b"<mediawiki"
    x, y = RandomWindowSampler(splits["val"], batch_size=2, seq_len=1024, seed=0).next_batch()
    assert x.shape == (2, 1024)
