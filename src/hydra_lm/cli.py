"""The ``hydra-lm`` command line: one sub-command per job, each implemented in its own module."""

from __future__ import annotations

import argparse
import sys


def _cmd_info(args: argparse.Namespace) -> int:
    from .info import print_info

    print_info(args.model_size, seq_len=args.seq_len, arch=args.arch, vocab_size=args.vocab_size)
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    run_demo(seed=args.seed)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hydra-lm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="parameters, FLOPs, cache size and head layout of a preset")
    info.add_argument("--model_size", default="100M", help="preset name (debug, 50M, 100M, ...)")
    info.add_argument("--arch", default="hydra", choices=["hydra", "dense"])
    info.add_argument("--seq_len", type=int, default=1024, help="sequence length for the FLOP count")
    info.add_argument("--vocab_size", type=int, default=None, help="override the preset's vocabulary size")
    info.set_defaults(func=_cmd_info)

    demo = sub.add_parser("demo", help="build the debug model, run a forward pass and a greedy generation")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as err:  # bad user input: one clear line, no traceback
        print(f"hydra-lm {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
