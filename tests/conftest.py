import pytest
import torch
import wandb

import train
from attention_cuda import _extension
from helpers import ENWIK8_4MB, TINY


def pytest_collection_modifyitems(config, items):
    """GPU tests skip cleanly on machines without CUDA, so CI on CPU stays green and honest."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def data_path(tmp_path_factory) -> str:
    if ENWIK8_4MB.is_file():
        return str(ENWIK8_4MB)
    path = tmp_path_factory.mktemp("data") / "synthetic"
    path.write_bytes(b"".join(b"<page><title>Item %d</title><text>The value is %d.</text></page>\n" % (i, i * i % 97)
                              for i in range(4000)))
    return str(path)


@pytest.fixture
def run(tmp_path, monkeypatch, data_path):
    """main() in-process, writing under tmp_path, with wandb offline and isolated there."""
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")

    def go(*args: str) -> int:
        return train.main([*TINY, "--data-path", data_path, "--out_dir", str(tmp_path / "out"), *args])

    go.out = tmp_path / "out"
    go.wandb_dir = tmp_path / "wandb"
    # wandb reads WANDB_DIR once per process, at its first setup: reset it so this test's dir counts.
    wandb.teardown()
    yield go
    wandb.teardown()


@pytest.fixture
def fake_kernels(monkeypatch):
    """Plans made as on a CUDA GPU with every kernel built: the head dims the extension reports for each kind of
    kernel are the fixture's attributes (chunked: the Hopper chunked kernels'; set fake_kernels.chunked = () for
    an sm_80 GPU). Only plans: nothing runs on them."""
    monkeypatch.setattr(_extension, "unavailable_reason", lambda: None)

    class Reports:
        compiled = sweep = decode = _extension.HEAD_DIMS
        chunked = (64, 128)

    for kind in ("compiled", "sweep", "chunked", "decode"):
        monkeypatch.setattr(_extension, f"{kind}_head_dims", lambda dtype, kind=kind: getattr(Reports, kind))
    return Reports


@pytest.fixture
def one_thread():
    """Tiny models run fastest on one thread, and far faster than on two when the machine is busy: a module
    with `pytestmark = pytest.mark.usefixtures("one_thread")` runs so."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

