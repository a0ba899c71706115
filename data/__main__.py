"""python -m data [--cache-dir DIR] [--data-path PATH]: fetch, verify and split enwik8 ahead of training.

A module of its own rather than ``python -m data.enwik8``, which would run data/enwik8.py a second time
after data/__init__.py has imported it.
"""
import argparse

from data.enwik8 import DEFAULT_CACHE_DIR, DataError, load_enwik8


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m data",
                                     description="Fetch, verify and split enwik8 ahead of training.")
    parser.add_argument("--cache-dir", default=DEFAULT_CACHE_DIR, help="where the verified download is kept")
    parser.add_argument("--data-path", default=None, help="a local raw / .zip / .gz copy to read instead")
    args = parser.parse_args(argv)
    try:
        load_enwik8(args.data_path, args.cache_dir)
    except DataError as err:
        raise SystemExit(f"error: {err}") from err


if __name__ == "__main__":
    main()
