"""A compiled training step in a second process loads its block graphs from the on-disk caches: inductor's FX graph
cache and AOTAutograd's cache, so that the joint forward and backward are not traced and partitioned again (the
graphs hold custom autograd functions, which AOTAutograd's cache skips unless the compile policy lets it in)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

# A process of its own per run: inductor's and Dynamo's in-process state are then fresh, as in a new training run.
_STEP = textwrap.dedent("""
    import torch
    from torch._dynamo.utils import counters
    from hydra_lm import create_model
    from hydra_lm.train.compile_policy import SpeedPlan, apply_speed_plan
    from hydra_lm.train.step import TrainStep

    torch.manual_seed(0)
    model = create_model("debug", dim=64, vocab_size=256).train()
    plan = SpeedPlan("units", "default", False, "naive", 4096)
    step = TrainStep(model, apply_speed_plan(model, model, plan), torch.optim.AdamW(model.parameters()),
                     torch.device("cpu"), plan)
    ids = torch.randint(0, 256, (2, 32))
    doc = (torch.arange(32) >= 12).long().expand(2, 32)
    step.micro({"input_ids": ids, "targets": torch.roll(ids, -1, 1), "doc_ids": doc})
    fx, aot = counters["inductor"], counters["aot_autograd"]
    print("CACHE", fx["fxgraph_cache_hit"], fx["fxgraph_cache_miss"], aot["autograd_cache_hit"],
          aot["autograd_cache_miss"], aot["autograd_cache_bypass"])
""")


def _run_step(cache_dir) -> dict[str, int]:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir)}
    env.pop("TORCHINDUCTOR_AUTOGRAD_CACHE_ALLOW_CUSTOM_AUTOGRAD", None)  # the policy's own setting, not the shell's
    out = subprocess.run([sys.executable, "-c", _STEP], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    counts = next(line for line in out.stdout.splitlines() if line.startswith("CACHE")).split()[1:]
    return dict(zip(["fx_hit", "fx_miss", "aot_hit", "aot_miss", "aot_bypass"], map(int, counts)))


def test_a_second_run_loads_the_block_graphs_without_tracing_them_again(tmp_path):
    cold = _run_step(tmp_path)
    # the debug model's two block layouts (routed at depth 0 or not), each one forward and one backward graph
    assert cold["fx_miss"] == 4 and cold["aot_miss"] == 2 and cold["aot_bypass"] == 0
    warm = _run_step(tmp_path)
    assert warm["fx_miss"] == 0 and warm["aot_miss"] == 0 and warm["aot_hit"] == 2 and warm["aot_bypass"] == 0
