"""Arguments and entry point of ``hydra-lm prepare``, for the command-line module to mount."""

from __future__ import annotations

import argparse


def add_prepare_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    # --input and --inputs are one list: every occurrence adds to it.
    parser.add_argument("--input", "--inputs", dest="inputs", nargs="*", action="extend", default=None,
                        help="files, directories, globs, hf:NAME[:CONFIG][:SPLIT], small_chat, nemotron; "
                             "none: the Python standard library source")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--vocab_size", type=int, default=8192, help="BPE vocabulary size to train")
    parser.add_argument("--tokenizer", default=None,
                        help="use this tokenizer instead of training one: tokenizer.json, a prepared directory, "
                             "tiktoken:NAME, or a Hugging Face model name present in the local cache")
    parser.add_argument("--val_fraction", type=float, default=0.02, help="share of documents held out")
    parser.add_argument("--seed", type=int, default=0, help="salt of the validation hash")
    parser.add_argument("--text_field", default="text", help="field holding the text in JSONL/Parquet/HF records")
    parser.add_argument("--max_bytes", type=int, default=None, help="read at most this many bytes of input")
    parser.add_argument("--force", action="store_true", help="rebuild even when the fingerprint matches")
    parser.add_argument("--no_progress", action="store_true", help="no progress bars or messages")
    return parser


def run_prepare(args: argparse.Namespace) -> int:
    from .prepare import prepare_data

    # An empty --input (an unset shell variable) is refused by prepare_data; only no --input is the built-in corpus.
    prepare_data(args.inputs, args.out, vocab_size=args.vocab_size, tokenizer=args.tokenizer,
                 val_fraction=args.val_fraction, seed=args.seed, text_field=args.text_field,
                 max_bytes=args.max_bytes, progress=not args.no_progress, force=args.force)
    return 0
