"""Helpers shared by the tests (imported as ``from support import ...``); the fixtures are in conftest.py."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Callable

import torch

import hydra_lm
from hydra_lm.cli import main

# Small enough for CPU tests, big enough to exercise every path: 3 blocks x 3 recursions, GQA 2:1
# in a latent of dim/4, MoD on every block so that routing changes the compacted sequences, and
# each MoR depth keeping half of the previous one's tokens (the default schedule, at a capacity that
# leaves the deepest depth more than a token or two of a short row).
TINY = dict(vocab_size=97, dim=64, n_blocks=3, recursions=3, n_heads=2, n_kv_heads=1, mlp_hidden=96,
            max_seq_len=128, mod_every=1, mod_capacity=0.5, mor_capacity=0.5)

VARIANTS = {
    "hydra": {},
    "mod_every_2": dict(mod_every=2, mod_capacity=0.75),
    "paper_schedule": dict(mor_capacity_schedule="paper"),
    "layer_aware": dict(mor_capacity_schedule="layer_aware"),
    "token_choice": dict(mor_routing="token"),
    "middle_cycle": dict(sharing="middle_cycle", n_blocks=4),
    "static": dict(static_routing_mode=True),
    "moe": dict(moe=True, moe_num_layers=2, moe_num_experts=3, moe_top_k=1),
    "moe_top2": dict(moe=True, moe_num_layers=1, moe_num_experts=3, moe_top_k=2),
    "no_routing": dict(mod_enabled=False, mor_enabled=False),
    "dense": dict(arch="dense", n_layers=3, n_heads=4, n_kv_heads=2),
}


def tokens_per_unit(model: hydra_lm.HydraModel, seq_len: int) -> dict[str, int]:
    """Tokens per row each unit (block, depth) of ``model`` runs on in top-k mode, as its curriculum stands."""
    return {f"{block.name}.depth{j}": k for block in model.blocks
            for j, k in enumerate(block.tokens_per_depth(seq_len))}


def tiny_model(seed: int = 0, **overrides) -> hydra_lm.HydraModel:
    torch.manual_seed(seed)
    return hydra_lm.create_model("debug", **{**TINY, **overrides})


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


def compare(data: Path, out: Path, *extra: str) -> int:
    """``hydra-lm compare`` of the tiny model on ``data`` into ``out``."""
    return main(["compare", "--data", str(data), "--out", str(out), *TINY_RUN, "--log_every", "2", *extra])


def records(run_dir: Path, kind: str | None = None) -> list[dict]:
    out = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in out if kind is None or r.get("kind") == kind]


def train_losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in records(run_dir, "train")]


def count_calls(monkeypatch, module, name: str, calls: dict, key: str) -> None:
    """Replace ``module.name`` by a wrapper that counts its calls in ``calls[key]``: that a path ran, which equal
    numbers alone cannot show."""
    real = getattr(module, name)

    def counted(*args, **kwargs):
        calls[key] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)


def compiled_graphs(fn) -> int:
    """Graphs Dynamo holds compiled for the function ``fn`` (every ``torch.compile`` of it)."""
    return len(torch._dynamo.eval_frame._debug_get_cache_entry_list(fn.__code__))


def rewrite_state(checkpoint: Path, edit: Callable[[dict], None], hashed: bool = True) -> None:
    """Edit ``checkpoint``'s state.json and hash it again, as a checkpoint written with that state would be
    (``hashed=False``: leave it without its hash, as checkpoints written before the state had one)."""
    from hydra_lm.train.checkpoint import STATE_HASH, state_digest

    path = Path(checkpoint) / "state.json"
    state = json.loads(path.read_text())
    edit(state)
    state.pop(STATE_HASH, None)
    if hashed:
        state[STATE_HASH] = state_digest(state)
    path.write_text(json.dumps(state))
