"""Sample bytes from a checkpoint that train.py wrote, printing them as they come.

    python sample.py --ckpt out/base_cosine --prompt "The history of " --max-new-bytes 500
    python sample.py --ckpt out/base_cosine/ckpt.pt --prompt-file prompt.txt --temperature 0.8 --top-p 0.95 --seed 7

The model is the checkpoint's (its config and weights; on a machine without a GPU, a run trained on our
kernels samples on the PyTorch reference of the same attention). Each new byte is drawn after the last
seq_len bytes of prompt and sample, at --temperature, from the --top-k most likely bytes and within those
from the smallest set holding --top-p of the probability. Bytes are printed as UTF-8 as they arrive, a
sequence that is not valid UTF-8 as U+FFFD. The same checkpoint, prompt, options and --seed give the same
bytes on the same device. Training's periodic samples are drawn by the same code (GPT.stream).
"""
from __future__ import annotations

import argparse
import codecs
import sys
from pathlib import Path

import torch

from lab.config import DTYPES, usage_error
from lab.files import load_checkpoint
from lab.steps import autocast_for, device_of, model_from_checkpoint
from model import GPT
from model.gpt import check_sampling


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sample.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt", required=True, help="a checkpoint train.py wrote, or its run directory")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="the text to continue (UTF-8)")
    prompt.add_argument("--prompt-file", help="a file whose bytes to continue")
    parser.add_argument("--max-new-bytes", type=int, default=256, help="bytes to sample (default %(default)s)")
    parser.add_argument("--temperature", type=float, default=1.0, help="> 0; lower is greedier (default %(default)s)")
    parser.add_argument("--top-k", type=int, default=None, help="sample among the k most likely bytes (1-256)")
    parser.add_argument("--top-p", type=float, default=None, help="nucleus: the smallest set of bytes holding p (0-1]")
    parser.add_argument("--seed", type=int, default=0, help="seeds the sampling (default %(default)s)")
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="auto", choices=DTYPES, help="auto: bfloat16 autocast on CUDA, float32 on CPU")
    args = parser.parse_args(argv)
    if args.max_new_bytes < 0:
        parser.error(f"--max-new-bytes: expected an int >= 0, got {args.max_new_bytes}")
    if not 0 <= args.seed < 2**63:
        parser.error(f"--seed: expected an int in [0, 2**63), got {args.seed}")
    try:
        check_sampling(args.temperature, args.top_k, args.top_p)
    except ValueError as err:
        parser.error(f"--{str(err).replace('_', '-')}")
    return args


def read_prompt(args: argparse.Namespace) -> bytes:
    if args.prompt_file is not None:
        try:
            prompt = Path(args.prompt_file).read_bytes()
        except OSError as err:
            usage_error(f"--prompt-file: cannot read {args.prompt_file}: {err.strerror or err}")
        if not prompt:
            usage_error(f"--prompt-file: {args.prompt_file} is empty; the model continues at least one byte")
        return prompt
    if not args.prompt:
        usage_error("--prompt: expected at least one character; the model continues at least one byte")
    return args.prompt.encode("utf-8", errors="surrogateescape")  # bytes a shell passed undecoded stay as they were


def load_model(args: argparse.Namespace) -> tuple[GPT, torch.device, torch.dtype]:
    path = Path(args.ckpt)
    ckpt = load_checkpoint(path / "ckpt.pt" if path.is_dir() else path, "--ckpt")
    overrides = {"device": args.device, "dtype": args.dtype, "compile": False}
    if device_of(args.device).type == "cpu" and ckpt["config"].get("use_cuda_kernel"):
        print(f"sample.py: {args.ckpt} trained on our CUDA kernels; sampling on the CPU with the PyTorch reference "
              f"of the same {ckpt['config']['attention']} attention", file=sys.stderr)
        overrides["use_cuda_kernel"] = False
    model, _, device, dtype = model_from_checkpoint(ckpt, f"--ckpt: {args.ckpt}", **overrides)
    return model.eval(), device, dtype


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    prompt = read_prompt(args)
    model, device, dtype = load_model(args)
    if len(prompt) > model.cfg.seq_len:
        print(f"sample.py: the prompt has {len(prompt):,} bytes; the model sees the last {model.cfg.seq_len:,} "
              "(its seq_len)", file=sys.stderr)
    idx = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    out = sys.stdout
    out.write(decoder.decode(prompt))
    with autocast_for(device, dtype):
        for byte in model.stream(idx, args.max_new_bytes, args.temperature, args.top_k, args.top_p, generator):
            out.write(decoder.decode(bytes([byte.item()])))
            out.flush()
    out.write(decoder.decode(b"", final=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
