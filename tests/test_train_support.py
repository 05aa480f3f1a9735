"""Shared pieces of the trainer/CLI tests: a tiny prepared corpus and a tiny model (no tests here)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from hydra_lm.cli import main

WORDS = ("the quick brown fox jumps over lazy dog and cat runs fast while bird sings song in tree "
         "def return import class self value list dict for while if else").split()

# A 2-block x 2-recursion model of width 64: every routing path, a fraction of a second per step.
TINY_MODEL = ["--model.dim", "64", "--model.n_heads", "2", "--model.n_kv_heads", "1", "--model.mlp_hidden", "128"]
TINY_RUN = ["--batch_size", "4", "--seq_len", "32", "--eval_batches", "2", "--device", "cpu", *TINY_MODEL]


def write_corpus(directory: Path, n_docs: int = 40, words: int = 300, seed: int = 0) -> Path:
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    for i in range(n_docs):
        (directory / f"doc{i}.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(words)))
    return directory


def prepare(corpus: Path, out: Path, vocab_size: int = 300) -> Path:
    code = main(["prepare", "--inputs", str(corpus), "--out", str(out), "--vocab_size", str(vocab_size),
                 "--val_fraction", "0.15", "--no_progress"])
    assert code == 0
    return out


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tiny_data")
    return prepare(write_corpus(root / "corpus"), root / "data")


def records(run_dir: Path, kind: str | None = None) -> list[dict]:
    out = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in out if kind is None or r.get("kind") == kind]


def train_losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in records(run_dir, "train")]
