"""Using finished (or running) runs: load a checkpoint's model, evaluate it, sample from it, export it.

Built on the training package's checkpoint, data and evaluation code; ``hydra_lm.train`` knows
nothing of this package.
"""

from __future__ import annotations

from .runs import LoadedRun, eval_run, export_model, generate_text, load_run

__all__ = ["LoadedRun", "eval_run", "export_model", "generate_text", "load_run"]
