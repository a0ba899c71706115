"""enwik8 as bytes: download and verify, split 90/5/5, random training windows, exhaustive eval windows."""
from data.batches import RandomWindowSampler, eval_windows, num_eval_targets
from data.enwik8 import (DEFAULT_CACHE_DIR, ENWIK8_URL, DataError, data_fingerprint, download_enwik8, load_enwik8,
                         read_local, split_enwik8, split_sizes)

__all__ = ["DEFAULT_CACHE_DIR", "ENWIK8_URL", "DataError", "RandomWindowSampler", "data_fingerprint",
           "download_enwik8", "eval_windows", "load_enwik8", "num_eval_targets", "read_local", "split_enwik8",
           "split_sizes"]
