"""``hydra-lm bench`` with some of inductor's settings changed, to see what they do to the cold first step and the
steady step (use a fresh ``TORCHINDUCTOR_CACHE_DIR`` and ``TRITON_CACHE_DIR`` per run, or the cache hides the compile).

    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d) python benchmarks/bench_inductor_setting.py \
        --set loop_ordering_after_fusion=0 --set triton.autotune_pointwise=0 -- --model_size 100M --arch hydra

Each ``--set NAME=0|1`` sets a boolean under ``torch._inductor.config`` before anything compiles; the arguments after
``--`` go to ``hydra-lm bench`` as they are.
"""

from __future__ import annotations

import argparse
import sys

import torch._inductor.config

from hydra_lm.cli import main


def apply(setting: str) -> None:
    name, _, value = setting.partition("=")
    if value not in ("0", "1"):
        raise SystemExit(f"--set {setting!r}: give NAME=0 or NAME=1")
    *path, leaf = name.split(".")
    owner = torch._inductor.config
    for part in path:
        owner = getattr(owner, part)
    if not isinstance(getattr(owner, leaf, None), bool):
        raise SystemExit(f"--set {setting!r}: torch._inductor.config.{name} is not a boolean setting")
    setattr(owner, leaf, value == "1")


if __name__ == "__main__":
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--set", action="append", default=[], metavar="NAME=0|1")
    for setting in p.parse_args(argv[:split]).set:
        apply(setting)
    sys.exit(main(["bench", *argv[split + 1:]]))
