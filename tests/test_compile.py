"""Routing keeps shapes static: the training step compiles as one graph and does not recompile."""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from hydra_lm.model.block import run_block, run_unit
from hydra_lm.model.routing import routed_selection
from hydra_lm.train.compile_policy import compile_units

from support import TINY, compiled_graphs, tiny_model, tokens_per_unit


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, TINY["vocab_size"], (2, 32), generator=g)
    return ids, torch.roll(ids, -1, 1)


def _assert_same_gradients(model, reference):
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, msg=name)


@pytest.mark.parametrize("overrides", [{}, {"mor_routing": "token"}, {"static_routing_mode": True}],
                         ids=["expert_choice", "token_choice", "static"])
@pytest.mark.slow
def test_training_step_compiles_fullgraph_without_recompiling(overrides):
    torch._dynamo.reset()
    model = tiny_model(**overrides).train()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    for seed in (1, 2):
        ids, targets = _batch(seed)
        out = compiled(ids, targets=targets)
        out["loss"].backward()
        eager = model(ids, targets=targets)
        torch.testing.assert_close(out["loss"], eager["loss"])
    assert counter.frame_count == 1, "a second batch of the same shape must reuse the compiled graph"


@pytest.mark.slow
def test_causal_eval_with_document_masks_compiles_fullgraph():
    torch._dynamo.reset()
    model = tiny_model().eval()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    doc = torch.tensor([[0] * 20 + [1] * 12] * 2)
    with torch.no_grad():
        for seed in (1, 2):
            ids, _ = _batch(seed)
            torch.testing.assert_close(compiled(ids, doc_ids=doc)["logits"], model(ids, doc_ids=doc)["logits"])
    assert counter.frame_count == 1


# The tiny model's first block runs the whole row at depth 0, the others are MoD-routed there: two block
# layouts, so two block graphs for training, whatever the batch; evaluation compiles the unit instead. With
# top-k over the batch the chosen entries are rows x k whatever the rows' counts: static shapes too, also when
# the causal rule's admissions come first ("causal").
@pytest.mark.parametrize("topk_over", ["row", "batch", "causal"])
@pytest.mark.slow
def test_compiled_training_reuses_one_graph_per_block_layout_and_keeps_the_state_dict(topk_over):
    torch._dynamo.reset()
    model, reference = tiny_model(topk_over=topk_over).train(), tiny_model(topk_over=topk_over).train()
    keys = list(model.state_dict())
    counter = CompileCounterWithBackend("aot_eager")
    assert compile_units(model, backend=counter) is model
    doc = torch.tensor([[0] * 20 + [1] * 12] * 2)
    for seed in (1, 2):
        ids, targets = _batch(seed)
        out = model(ids, targets=targets, doc_ids=doc)
        out["loss"].backward()
        ref = reference(ids, targets=targets, doc_ids=doc)
        ref["loss"].backward()
        torch.testing.assert_close(out["loss"], ref["loss"])
    _assert_same_gradients(model, reference)
    for (name, b), c in zip(model.named_buffers(), reference.buffers()):  # the routers' calibrated thresholds
        torch.testing.assert_close(b, c, msg=name)
    assert compiled_graphs(run_block) == 2 and counter.frame_count == 2
    assert compiled_graphs(run_unit) == 0 and compiled_graphs(routed_selection) == 0  # inside the block graphs
    assert list(model.state_dict()) == keys


@pytest.mark.slow
def test_compiled_training_matches_eager_with_few_graphs():
    """Blocks and the fused loss's chunks compiled (chunks of 24 rows: two sizes); MoD on every 2nd
    block, so ungated full-row units and gated ones occur. Loss and every gradient equal eager's,
    and a second batch compiles nothing new."""
    torch._dynamo.reset()
    model, reference = tiny_model(mod_every=2).train(), tiny_model(mod_every=2).train()
    for m in (model, reference):
        m.ce_impl, m.ce_chunk_size = "chunked", 24
    counter = CompileCounterWithBackend("aot_eager")
    compile_units(model, backend=counter)
    for seed in (1, 2):
        ids, targets = _batch(seed)
        out, ref = model(ids, targets=targets), reference(ids, targets=targets)
        out["loss"].backward()
        ref["loss"].backward()
        torch.testing.assert_close(out["loss"], ref["loss"])
        if seed == 1:
            first = counter.frame_count
    _assert_same_gradients(model, reference)
    # two block layouts (routed at depth 0 or not), two loss-chunk sizes (64 = 24 + 24 + 16)
    assert compiled_graphs(run_block) == 2
    assert first == 4 and counter.frame_count == first


@pytest.mark.slow
def test_one_token_units_train_in_the_block_graphs_and_evaluate_in_one_dynamic_unit_graph():
    """A geometric schedule whose deep depths keep one token per row (4 / 1 / 1 of 32, like the 100M
    preset's 128/16/2/1 of 1,024): training runs them inside the static block graphs; evaluation's
    units run padded with a copy of the entry, so no unit graph is compiled for one token. Loss,
    gradients and evaluation logits equal eager's."""
    torch._dynamo.reset()
    routing = dict(mod_every=2, mod_capacity=0.125, mor_capacity=0.125, mor_capacity_schedule="geometric")
    model, reference = tiny_model(**routing).train(), tiny_model(**routing).train()
    assert 1 in tokens_per_unit(model, 32).values()
    counter = CompileCounterWithBackend("aot_eager")
    compile_units(model, backend=counter)
    doc = torch.tensor([[0] * 20 + [1] * 12] * 2)
    for seed in (1, 2):
        ids, targets = _batch(seed)
        out, ref = model(ids, targets=targets, doc_ids=doc), reference(ids, targets=targets, doc_ids=doc)
        out["loss"].backward()
        ref["loss"].backward()
        torch.testing.assert_close(out["loss"], ref["loss"])
    _assert_same_gradients(model, reference)
    assert compiled_graphs(run_unit) == 0
    with torch.no_grad():
        model.eval(), reference.eval()
        for mode in ("causal", "topk"):
            torch.testing.assert_close(model(ids, doc_ids=doc, routing=mode)["logits"],
                                       reference(ids, doc_ids=doc, routing=mode)["logits"])
    assert compiled_graphs(run_unit) == 1, ("evaluation compiles one graph without gradients for whole rows and "
                                            "masked causal entries alike, and none for one token")
    assert compiled_graphs(routed_selection) == 0  # evaluation's selections run eager


@pytest.mark.slow
def test_a_mor_ramp_in_progress_trains_in_the_dynamic_unit_graph():
    """While the MoR ramp moves the depths' token counts (a new count at each level) the blocks' static graphs
    would compile again at each: training then runs the dynamic unit graph, and equals eager."""
    torch._dynamo.reset()
    model, reference = tiny_model().train(), tiny_model().train()
    compile_units(model, backend="aot_eager")
    for ramp, seed in ((0.3, 1), (0.6, 2)):
        for m in (model, reference):
            m.set_curriculum(mor_ramp=ramp)
        ids, targets = _batch(seed)
        out, ref = model(ids, targets=targets), reference(ids, targets=targets)
        out["loss"].backward()
        ref["loss"].backward()
        torch.testing.assert_close(out["loss"], ref["loss"])
    _assert_same_gradients(model, reference)
    assert compiled_graphs(run_block) == 0 and compiled_graphs(run_unit) == 1


def test_compiled_moe_blocks_run_off_the_grouped_gemm():
    """Off CUDA's bf16 grouped GEMM the experts run as a loop that reads their slices' bounds on the host; the
    compiled MoE blocks run it (a graph break there) and give eager's loss and gradients."""
    torch._dynamo.reset()
    model, reference = (tiny_model(moe=True, moe_num_layers=1, moe_num_experts=3, moe_top_k=2).train()
                        for _ in range(2))
    compile_units(model, backend="eager")
    ids, targets = _batch(1)
    out, ref = model(ids, targets=targets), reference(ids, targets=targets)
    out["loss"].backward()
    ref["loss"].backward()
    torch.testing.assert_close(out["loss"], ref["loss"])
    _assert_same_gradients(model, reference)


def test_the_compile_trace_summary_counts_each_compiled_frame_and_its_phases(tmp_path):
    """benchmarks/compile_trace_summary.py reads what a run under TORCH_TRACE wrote: its frames forward and backward,
    and the time in each named phase (here without inductor, whose C++ builds take minutes on a CPU)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = ("import torch\nlin = torch.nn.Linear(8, 8)\nf = torch.compile(lambda x: lin(x).relu().sum(), "
            "backend='aot_eager')\nf(torch.randn(4, 8)).backward()\n")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "TORCH_TRACE": str(tmp_path)})
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "compile_trace_summary.py"
    out = subprocess.run([sys.executable, str(script), str(tmp_path)], check=True, capture_output=True,
                         text=True).stdout
    lines = out.splitlines()
    assert lines[0].startswith("forward: 1 compiled frames; entire_frame_compile ")
    phases = {line.split()[0]: int(line.split()[-1]) for line in lines[3:]}
    assert phases["entire_frame_compile"] == 1 and phases["backend_compile"] == 1
    empty = subprocess.run([sys.executable, str(script), str(tmp_path / "none")], capture_output=True, text=True)
    assert empty.returncode != 0 and "run with TORCH_TRACE=" in empty.stderr
