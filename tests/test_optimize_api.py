"""``hydra_lm.optimize_for_gpu`` / ``create_optimized_training_setup``: the trainer's speed policy and
step behind one call (CPU here: eager, with a warning; the CUDA path is in test_gpu.py)."""

import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import hydra_lm
from hydra_lm.train.compile_policy import apply_speed_plan, resolve_speed_options
from hydra_lm.train.optim import build_optimizer
from hydra_lm.train.options import TrainConfig
from hydra_lm.train.step import TrainStep

from support import TINY, tiny_model


def _batches(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, TINY["vocab_size"], (4, 32), generator=g)
        out.append({"input_ids": ids, "targets": torch.roll(ids, -1, 1)})
    return out


def test_setup_trains_eagerly_on_cpu_and_says_so():
    with pytest.warns(UserWarning, match="eagerly"):
        setup = hydra_lm.create_optimized_training_setup(tiny_model(), lr=3e-3)
    assert "eager" in setup.description and setup.train_step.graphs is None
    assert isinstance(setup.optimizer, torch.optim.AdamW)
    batch = _batches(1)[0]
    losses = [float(setup.step(batch)["loss"]) for _ in range(6)]
    assert losses[-1] < losses[0] - 0.05, losses
    out = setup.step(batch["input_ids"])  # ids alone: next-token targets
    assert set(out) == {"loss", "ce_loss", "aux_loss", "ponder_loss", "moe_loss", "grad_norm", "routing_stats"}
    with pytest.raises(ValueError, match="grad_accum"):
        setup.step([batch, batch])


def test_setup_step_is_the_trainers_step():
    """Same seed, same batches: the setup's losses equal those of TrainStep built as the trainer does."""
    with pytest.warns(UserWarning):
        setup = hydra_lm.create_optimized_training_setup(tiny_model(), lr=1e-3, weight_decay=0.05)
    model, cfg, cpu = tiny_model(), TrainConfig(lr=1e-3, weight_decay=0.05, grad_clip=1.0, grad_accum=1), \
        torch.device("cpu")
    plan = resolve_speed_options(cfg, cpu, distributed=False)
    step = TrainStep(model, apply_speed_plan(model, model, plan), build_optimizer(model, cfg, cpu), cpu, plan, 1, 1.0)
    model.train()
    got, want = [], []
    for batch in _batches(5):
        got.append(float(setup.step(batch)["loss"]))
        parts, _ = step.micro(batch)
        step.update()
        want.append(float(parts[0]))
    assert got == want


def test_gradient_accumulation_takes_a_list_of_micro_batches():
    """Two micro-batches a step: the trainer's accumulated step, losses and weights alike."""
    with pytest.warns(UserWarning):
        setup = hydra_lm.create_optimized_training_setup(tiny_model(), lr=1e-3, grad_accum=2)
    model, cfg, cpu = tiny_model(), TrainConfig(lr=1e-3, grad_clip=1.0, grad_accum=2), torch.device("cpu")
    plan = resolve_speed_options(cfg, cpu, distributed=False)
    step = TrainStep(model, apply_speed_plan(model, model, plan), build_optimizer(model, cfg, cpu), cpu, plan, 2, 1.0)
    model.train()
    batches = _batches(4)
    for pair in (batches[:2], batches[2:]):
        got = setup.step(pair)
        want = sum(step.micro(b)[0] for b in pair) / 2  # the mean over the micro-batches
        step.update()
        assert float(got["loss"]) == float(want[0])
    for a, b in zip(setup.model.parameters(), model.parameters()):
        assert torch.equal(a, b)


def test_a_sophia_setup_estimates_the_hessian_when_due_as_the_trainer_does():
    """No batch shape among the options: the first step's tokens scale the estimate (the trainer's batch x length x
    accumulation); the estimate follows the first update and every sophia_update_period-th after, as in train."""
    from hydra_lm.train.sophia import SophiaG

    with pytest.warns(UserWarning):
        setup = hydra_lm.create_optimized_training_setup(tiny_model(), lr=1e-3, optimizer="sophia",
                                                         sophia_update_period=2)
    assert isinstance(setup.optimizer, SophiaG)
    estimates, fold = [], setup.optimizer.update_hessian
    setup.optimizer.update_hessian = lambda: (estimates.append(setup.optimizer.param_groups[0]["steps"]), fold())
    batch = _batches(1)[0]
    for _ in range(4):
        out = setup.step(batch)
    assert torch.isfinite(out["loss"]) and setup.optimizer.tokens_per_batch == 4 * 32
    assert estimates == [1, 3]
    assert any(float(state["hessian"].abs().sum()) > 0 for state in setup.optimizer.state.values())
    unset = SophiaG(tiny_model().parameters(), lr=1e-3, tokens_per_batch=None)
    with pytest.raises(ValueError, match="tokens_per_batch is not set"):
        unset.step()


def test_the_setup_applies_the_moe_lr_scales_and_the_router_warm_up():
    """As the trainer: the experts at moe_expert_lr_scale from the first step, the routers held (LR 0) for
    moe_warmup_steps updates, a set_lr in between included, and learning after them."""
    model = tiny_model(moe=True, moe_num_layers=1, moe_num_experts=3, moe_top_k=1)
    with pytest.warns(UserWarning):
        setup = hydra_lm.create_optimized_training_setup(model, lr=1e-3, moe_expert_lr_scale=0.0,
                                                         moe_warmup_steps=2)
    moe = next(iter(model.moe_blocks.values()))
    router, experts, embed = moe.router.weight, moe.w_gate_up, model.embed.weight
    initial = [p.detach().clone() for p in (router, experts, embed)]
    ids = _batches(1)[0]["input_ids"]
    setup.step(ids)
    setup.set_lr(1e-3)
    setup.step(ids)
    assert torch.equal(router, initial[0]) and torch.equal(experts, initial[1])
    assert not torch.equal(embed, initial[2])
    setup.step(ids)
    assert not torch.equal(router, initial[0]) and torch.equal(experts, initial[1])


@pytest.mark.parametrize("options, message", [
    (dict(weight_decay=-1.0), "weight_decay=-1.0 must be >= 0"),
    (dict(grad_clip=-5.0), "grad_clip=-5.0 must be >= 0"),
    (dict(lr=0.0, optimizer="muon"), "lr=0.0 must be > 0"),
    (dict(grad_accum=0), "grad_accum=0 must be >= 1"),
    (dict(compile="yes"), "compile='yes' must be of type bool"),
    (dict(moe=True, moe_num_experts=4), "give moe, moe_num_experts to hydra_lm.create_model instead"),
    # the trainer's loop, which a setup does not run: refused, not silently dropped
    (dict(warmup_steps=100, schedule="cosine", mod_off=True), "mod_off, schedule, warmup_steps belong to hydra-lm "
                                                               "train's loop"),
])
def test_the_setup_refuses_what_the_trainer_refuses(options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        hydra_lm.create_optimized_training_setup(tiny_model(), **options)


def test_the_setup_takes_the_trainers_flag_aliases():
    with pytest.warns(UserWarning):
        hydra_lm.optimize_for_gpu(tiny_model(), compile_units=True)
    with pytest.raises(ValueError, match="--cuda_graph needs a CUDA device"):  # what the alias sets
        hydra_lm.optimize_for_gpu(tiny_model(), experimental_cuda_graphs=True)
    # The optimizer is an argument of its own, which would override the alias.
    with pytest.raises(ValueError, match="adafactor: pass optimizer='adafactor' to create_optimized_training_setup"):
        hydra_lm.create_optimized_training_setup(tiny_model(), adafactor=True)


def test_the_setup_applies_the_trainers_model_settings():
    """As hydra-lm train (the same code): gradient checkpointing applied (checkpoint_every implies it), FA3 reported;
    float8 off CUDA and MoE settings without MoE layers refused; on a module other than a HydraModel, all refused."""
    model = tiny_model()
    with pytest.warns(UserWarning):
        setup = hydra_lm.create_optimized_training_setup(model, checkpoint_every=2, experimental_fa3=True)
    assert model.gradient_checkpointing and model.checkpoint_every == 2
    assert "gradient checkpointing (every 2 blocks)" in setup.description
    assert "--experimental_fa3: " in setup.description
    assert torch.isfinite(setup.step(_batches(1)[0])["loss"])
    with pytest.raises(ValueError, match="--experimental_fp8 needs a CUDA GPU"):
        hydra_lm.create_optimized_training_setup(tiny_model(), experimental_fp8=True)
    with pytest.raises(ValueError, match="--moe_warmup_steps tune MoE layers, which this model has none of"):
        hydra_lm.create_optimized_training_setup(tiny_model(), moe_warmup_steps=100)
    with pytest.raises(ValueError, match="gradient_checkpointing: the setup applies these to a HydraModel only"):
        hydra_lm.optimize_for_gpu(torch.nn.Linear(8, 8), checkpoint_every=1)


def test_the_plan_follows_the_models_own_checkpointing_and_a_refused_setup_leaves_the_model_as_it_was():
    model = tiny_model()
    model.gradient_checkpointing = True  # set on the model, as docs/python_api.md shows
    with pytest.warns(UserWarning):
        setup = hydra_lm.create_optimized_training_setup(model)
    # planned with it (on CUDA: no graphs around a checkpointed step, which the policy refuses)
    assert "gradient checkpointing" in setup.description
    fresh = tiny_model()
    with pytest.raises(ValueError, match="adam8bit"):
        hydra_lm.create_optimized_training_setup(fresh, optimizer="adam8bit", gradient_checkpointing=True)
    assert not fresh.gradient_checkpointing


def test_a_curriculum_switch_between_steps_captures_the_step_again():
    with pytest.warns(UserWarning):
        setup = hydra_lm.create_optimized_training_setup(tiny_model())
    resets = []
    setup.train_step.graphs = type("Graphs", (), {"reset": lambda self: resets.append(setup.steps)})()
    setup.train_step.micro = lambda inputs: (torch.zeros(5), torch.zeros(1))  # the step's work is not the point
    setup.train_step.update = lambda: torch.zeros(())
    batch = _batches(1)[0]
    setup.step(batch)
    setup.step(batch)
    setup.model.set_curriculum(mod_active=False)
    setup.step(batch)
    setup.step(batch)
    assert resets == [2]


def test_the_cpu_warning_names_what_is_off():
    with pytest.warns(UserWarning, match=r"runs eagerly on cpu \(no compile, CUDA graphs or fused loss\)"):
        hydra_lm.optimize_for_gpu(tiny_model())
    with pytest.warns(UserWarning, match=r"runs eagerly on cpu \(no compile or CUDA graphs\)$") as caught:
        optimized = hydra_lm.optimize_for_gpu(tiny_model(), chunked_ce=True)
    assert optimized.model.ce_impl != "naive" and "fused" not in str(caught[0].message)


def test_a_batch_of_the_wrong_shape_is_one_clear_error():
    with pytest.warns(UserWarning):
        setup = hydra_lm.create_optimized_training_setup(tiny_model(), lr=1e-3)
    with pytest.raises(ValueError, match=r"a batch is \[rows, length\]"):
        setup.step(torch.randint(0, 97, (16,)))


def test_optimize_for_gpu_on_cpu_is_eager_for_any_module():
    model = tiny_model()
    with pytest.warns(UserWarning, match="eagerly"):
        opt = hydra_lm.optimize_for_gpu(model)
    assert opt.module is model and opt.plan.compile is None and not opt.plan.cuda_graph
    assert opt.capabilities.device.type == "cpu" and "eager" in opt.description
    plain = torch.nn.Sequential(torch.nn.Linear(8, 8))
    with pytest.warns(UserWarning):
        assert hydra_lm.optimize_for_gpu(plain).module is plain
    with pytest.warns(UserWarning):  # compiled whole: no block layouts for helper processes to compile
        assert not hydra_lm.optimize_for_gpu(plain, compile=True, parallel_compile=True).plan.parallel_compile
    with pytest.raises(ValueError, match="unknown training key"):
        hydra_lm.optimize_for_gpu(model, compiel=True)


class _LossOnly(torch.nn.Module):  # a language model that returns its loss alone
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(TINY["vocab_size"], 8)
        self.head = torch.nn.Linear(8, TINY["vocab_size"])

    def forward(self, ids, targets=None):
        return {"loss": F.cross_entropy(self.head(self.embed(ids)).flatten(0, 1), targets.flatten())}


def test_a_module_without_the_step_outputs_is_told_what_the_step_reads():
    with pytest.warns(UserWarning):
        setup = hydra_lm.create_optimized_training_setup(_LossOnly())
    with pytest.raises(ValueError, match=r"returned \['loss'\]; a training step reads \['aux_loss', 'ce_loss'"):
        setup.step(_batches(1)[0])


def test_root_exports_are_lazy():
    code = ("import sys, hydra_lm; assert 'hydra_lm.train.optimize' not in sys.modules; "
            "from hydra_lm import optimize_for_gpu, create_optimized_training_setup; "
            "assert 'hydra_lm.train.optimize' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
    assert "optimize_for_gpu" in hydra_lm.__all__


def test_a_graphed_step_refuses_batches_whose_tensors_change(monkeypatch):
    """A captured step replays on fixed buffers: a batch that leaves one out (doc_ids, say) would run on the previous
    batch's; one that adds a tensor has no buffer. Both get one clear error. (GraphedStep needs CUDA: a stand-in
    that calls the step function records what it saw.)"""
    from hydra_lm.train import graphed_train_step as gts

    class Eager:
        def __init__(self, fn, warmup, before_capture=None):
            self.fn, self.captured = fn, False

        def __call__(self):
            return self.fn()

    monkeypatch.setattr(gts, "GraphedStep", Eager)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)
    step = gts.GraphedTrainStep(lambda **b: sorted(b), lambda: None, torch.device("cpu"), graph_update=False)
    ids = torch.zeros(1, 4, dtype=torch.long)
    assert step.micro({"input_ids": ids, "targets": ids, "doc_ids": ids}) == ["doc_ids", "input_ids", "targets"]
    for batch in ({"input_ids": ids, "targets": ids}, {"input_ids": ids, "targets": ids, "doc_ids": ids, "x": ids}):
        with pytest.raises(ValueError, match="every batch must hold the same tensors"):
            step.micro(batch)
