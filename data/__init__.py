"""The training data, as bytes. enwik8: download and verify, split 90/5/5, random training windows,
exhaustive eval windows. Recall: generated multi-query associative recall sequences and their scorer."""
from data.batches import RandomWindowSampler, eval_windows, num_eval_targets
from data.enwik8 import (DEFAULT_CACHE_DIR, ENWIK8_URL, DataError, data_fingerprint, download_enwik8, load_enwik8,
                         read_local, split_enwik8, split_sizes)
from data.recall import RecallSampler, RecallTask, score

__all__ = ["DEFAULT_CACHE_DIR", "ENWIK8_URL", "DataError", "RandomWindowSampler", "RecallSampler", "RecallTask",
           "data_fingerprint", "download_enwik8", "eval_windows", "load_enwik8", "num_eval_targets", "read_local",
           "score", "split_enwik8", "split_sizes"]
