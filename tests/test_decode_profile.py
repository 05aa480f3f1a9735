"""benchmarks/decode_profile.py attributes a decode step's work to the step's ops: as many unit calls as the
step itself counts, one embedding and one head per step, and kernels (on a CPU, ATen ops) under each."""

import importlib.util
from pathlib import Path

import torch

from support import tiny_model

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "decode_profile.py"


def _load():
    spec = importlib.util.spec_from_file_location("decode_profile", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_profile_counts_the_ops_the_step_runs():
    torch.manual_seed(0)
    result = _load().profile_step(tiny_model().eval(), batch=2, prompt_len=8, steps=4)
    kinds, steps = result["kinds"], result["steps"]
    assert kinds["unit"]["calls"] == result["unit_calls"] > 0  # skipped units are not profiled
    assert kinds["embed"]["calls"] == kinds["head"]["calls"] == steps
    assert kinds["route"]["calls"] > 0
    for name, kind in kinds.items():
        assert kind["kernels"] > 0 and kind["time_us"] > 0 and kind["top"], name
