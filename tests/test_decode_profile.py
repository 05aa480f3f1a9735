"""benchmarks/decode_profile.py attributes a decode step's work to the step's ops: as many unit calls as the
step itself counts, one embedding and one head per step, and kernels (on a CPU, ATen ops) under each;
benchmarks/decode_rates.py times both archs' decoding."""

import importlib.util
import json
from pathlib import Path

import torch

from support import tiny_model

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "decode_profile.py"


def _load(script: Path = SCRIPT):
    spec = importlib.util.spec_from_file_location(script.stem, script)
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


def test_decode_rates_times_both_archs_and_counts_units(tmp_path):
    # A small vocabulary: the calibration's logits at 50,257 would grow this process by GBs, which a later
    # subprocess's peak RSS inherits (test_memory_estimate.py).
    args = ["--model_size", "debug", "--vocab_size", "256", "--batches", "2", "--calibrate", "1", "--new_tokens", "8",
            "--device", "cpu", "--json", str(tmp_path / "r.json")]
    rows = _load(SCRIPT.with_name("decode_rates.py")).main(args)
    assert [(r["arch"], r["batch"]) for r in rows] == [("hydra", 2), ("dense", 2)]
    assert all(r["tokens_per_s"] > 0 for r in rows)
    assert 0 < rows[0]["units_per_step"] <= 4 and rows[1]["units_per_step"] == 2  # debug: 2 x 2 units, 2 layers
    assert json.loads((tmp_path / "r.json").read_text()) == rows
