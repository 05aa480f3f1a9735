"""--optimizer: every optimizer trains, resumes bit-exactly from its checkpointed state, and refuses
what it cannot run; the Muon/AdamW split and the per-optimizer LR defaults."""

import copy
import importlib.util
import math

import pytest
import torch

from hydra_lm.cli import main
from hydra_lm.train import optim
from hydra_lm.train.options import TrainConfig, resolve
from support import TINY_RUN, tiny_model, train_losses

RESUMABLE = ["adafactor", "lion", "clion", "muon", "sophia", "adam8bit"]


def train(data, run, *extra):
    return main(["train", "--data", str(data), "--out", str(run), *TINY_RUN, "--log_every", "1",
                 "--no-eval_at_start", "--eval_every", "0", *extra])


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.gpu) if n == "adam8bit" else n for n in RESUMABLE])
def test_interrupted_run_resumes_exactly(tiny_data, tmp_path, name):
    device = []
    if name == "adam8bit":  # torchao compiles its step: minutes of C++ builds on a CPU, so CUDA only (gpu mark)
        if importlib.util.find_spec("torchao") is None:
            pytest.skip("needs torchao")
        device = ["--device", "cuda"]
    # MoR switches on at step 2: routers start without state mid-run; Sophia re-estimates its
    # Hessian at steps 0 and 2 (after the resume).
    common = ["--optimizer", name, "--max_steps", "4", "--save_every", "2", "--mod_off", "--mor_enable_pct", "0.5",
              "--sophia_update_period", "2", *device]
    assert train(tiny_data, tmp_path / "straight", *common) == 0
    assert train(tiny_data, tmp_path / "pieces", *common, "--stop_at_step", "2") == 0
    assert main(["train", "--out", str(tmp_path / "pieces")]) == 0
    straight = train_losses(tmp_path / "straight")
    assert [s for s, _ in straight] == list(range(1, 5))
    assert train_losses(tmp_path / "pieces") == straight  # bit-identical per-step losses
    assert straight[-1][1] < straight[0][1]  # it learns


def test_muon_takes_hidden_matrices_and_adamw_the_rest():
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from hydra_lm.train.sharded_checkpoint import load_optimizer

    def build(**model):
        model = tiny_model(0, mor_routing="token", **model)
        return model, optim.build_optimizer(model, TrainConfig(optimizer="muon", lr=0.02, adamw_lr=0.004),
                                            torch.device("cpu"))

    model, opt = build(moe=True, moe_num_layers=1, moe_num_experts=3)
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {names[id(p)] for g in opt._muon.param_groups for p in g["params"]}
    adamw = {names[id(p)] for g in opt._adamw.param_groups for p in g["params"]}
    assert muon and muon | adamw == set(names.values()) and not muon & adamw
    assert all(".layers." in n and (".attn." in n or ".mlp." in n) and n.endswith("weight") for n in muon)
    assert {"embed.weight", "moe_blocks.0.router.weight", "moe_blocks.0.w_gate_up", "blocks.0.rec_emb",
            "blocks.0.depth_router.proj.weight", "blocks.1.routers.0.proj.weight", "norm.weight"} <= adamw
    optim.set_lr(opt, 0.01)  # the scheduled LR; AdamW keeps its 0.004/0.02 share
    assert {g["lr"] for g in opt._muon.param_groups} == {0.01}
    assert [g["lr"] for g in opt._adamw.param_groups] == pytest.approx([0.002] * len(opt._adamw.param_groups))

    # The state round trip, without MoE (whose CPU backward is not bit-reproducible).
    model, opt = build()
    optim.set_lr(opt, 0.01)

    def step(model, opt, seed):
        torch.manual_seed(seed)
        x = torch.randint(0, 97, (2, 16))
        model(x, targets=x)["loss"].backward()
        opt.step()
        opt.zero_grad()

    for seed in (1, 2):
        step(model, opt, seed)
    # The trainer's checkpoint path (state keyed by name); a copy, as if read back from disk.
    saved = copy.deepcopy(get_optimizer_state_dict(model, opt))
    assert "blocks.0.layers.0.mlp.down.weight" in saved["state"] and "embed.weight" in saved["state"]
    fresh_model, fresh = build()
    fresh_model.load_state_dict(model.state_dict())
    load_optimizer(fresh_model, fresh, saved)  # the trainer's restore path
    assert fresh._muon.state is fresh.state and fresh._muon.param_groups[0] is fresh.param_groups[0]
    step(model, opt, 3)
    step(fresh_model, fresh, 3)
    for a, b in zip(model.parameters(), fresh_model.parameters()):
        assert torch.equal(a, b)


def test_sophia_g_estimates_the_hessian_when_due_and_clips_its_steps():
    from hydra_lm.train.sophia import SophiaG

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = SophiaG(model.parameters(), lr=0.1, weight_decay=0.0, update_period=2, tokens_per_batch=16)
    x = torch.randn(16, 8)
    due = []
    for _ in range(4):
        before = model.weight.detach().clone()
        (model(x) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
        # Every coordinate moves by at most the LR (clipped); before any estimate, by exactly the LR.
        moved = (model.weight - before).abs()
        assert float(moved.max()) <= 0.1 + 1e-7
        if not due:
            assert torch.allclose(moved, torch.full_like(moved, 0.1))
        due.append(opt.hessian_due())
        if due[-1]:
            (model(x) ** 2).mean().backward()
            opt.update_hessian()
            opt.zero_grad()
    assert due == [True, False, True, False]  # after the first step, then every update_period
    hessian = opt.state[model.weight]["hessian"]
    assert float(hessian.min()) > 0
    # With curvature known, a coordinate whose momentum is small against it moves less than the clip.
    assert float((opt.state[model.weight]["exp_avg"].abs() / (0.04 * 16 * hessian)).min()) < 1


def test_the_trainer_estimates_sophias_hessian_on_sampled_labels(tiny_data, tmp_path, monkeypatch):
    """After steps 1 and 3 of 4 (period 2) the trainer runs one more forward + backward, on labels drawn
    from the model's predictions, and hands its (non-zero) gradients to ``update_hessian``."""
    from hydra_lm.train.sophia import SophiaG

    seen = []
    fold = SophiaG.update_hessian

    def update_hessian(self):
        seen.append(self.param_groups[0]["steps"])
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        assert grads and sum(float(g.abs().sum()) for g in grads) > 0
        fold(self)

    monkeypatch.setattr(SophiaG, "update_hessian", update_hessian)
    assert train(tiny_data, tmp_path / "run", "--optimizer", "sophia", "--max_steps", "4",
                 "--sophia_update_period", "2") == 0
    assert seen == [1, 3]
    losses = [loss for _, loss in train_losses(tmp_path / "run")]
    assert len(losses) == 4 and all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]


def test_sophias_curvature_counts_the_tokens_of_the_micro_batch_it_samples():
    """The sampled-label loss runs on one micro-batch, so its squared gradients scale by that batch's tokens: the
    step's (times grad_accum) made the preconditioner grad_accum times too large, rho in effect as much larger."""
    from hydra_lm.train.optim import build_optimizer

    model = tiny_model()
    for accum in (1, 4):
        cfg = resolve(TrainConfig(optimizer="sophia", batch_size=4, seq_len=32, grad_accum=accum), "debug",
                      on_cuda=False)
        assert build_optimizer(model, cfg, torch.device("cpu")).tokens_per_batch == 4 * 32


def test_per_optimizer_learning_rate_defaults():
    lrs = {name: resolve(TrainConfig(optimizer=name), "100M", on_cuda=True).lr for name in ("adamw", "lion", "muon")}
    assert lrs == {"adamw": 6e-4, "lion": pytest.approx(1.8e-4), "muon": pytest.approx(1.5e-3)}
    assert resolve(TrainConfig(optimizer="lion", lr=1e-3), "100M", on_cuda=True).lr == 1e-3  # explicit wins


@pytest.mark.parametrize("flags, message", [
    (["--optimizer", "lion", "--adamw_lr", "1e-3"], "--adamw_lr sets the AdamW part of --optimizer muon"),
    (["--optimizer", "sophia", "--beta2", "0.99"], "--beta2 0.99: the betas of adamw, adam8bit, muon .*--optimizer "
                                                   "sophia keeps its own"),
    (["--optimizer", "lion", "--beta1", "0.8", "--beta2", "0.9"], "--beta1 0.8 --beta2 0.9: .*--optimizer lion"),
    # FlexAttention has no CPU backward: the run is refused before it, naming the setting
    (["--model.doc_mask_backend", "flex"], "doc_mask_backend flex trains on CUDA only .* use --model.doc_mask_backend "
                                           "auto"),
])
def test_unsupported_combinations_are_one_line_errors(tiny_data, tmp_path, capsys, flags, message):
    import re

    assert train(tiny_data, tmp_path / "run", "--max_steps", "1", *flags) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(message, err[0]), err


def test_muon_refuses_fsdp_shards():
    from hydra_lm.train.distributed import DistInfo

    with pytest.raises(ValueError, match="add --parallel ddp"):
        optim.check_optimizer_features(TrainConfig(optimizer="muon"), DistInfo(world_size=2, parallel="fsdp"))
    optim.check_optimizer_features(TrainConfig(optimizer="muon"), DistInfo(world_size=2, parallel="ddp"))


@pytest.mark.slow  # two CLI training runs, one compiled (like the other compile runs)
def test_compiled_muon_step_gives_the_eager_numbers(tiny_data, tmp_path, monkeypatch):
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")  # the trainer's graph, without inductor's C++ build on CPU
    compile_fn = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, mode=None, options=None, **kw:
                        compile_fn(model, backend=counter, **kw))
    torch._dynamo.reset()
    common = ["--optimizer", "muon", "--max_steps", "2", "--mod_off", "--mor_off"]
    assert train(tiny_data, tmp_path / "eager", *common) == 0
    assert train(tiny_data, tmp_path / "compiled", *common, "--compile") == 0
    assert counter.frame_count >= 1
    eager = [loss for _, loss in train_losses(tmp_path / "eager")]
    assert eager == pytest.approx([loss for _, loss in train_losses(tmp_path / "compiled")], rel=1e-5)


def test_muon_step_is_torch_muon_and_takes_a_tensor_learning_rate():
    """train/muon.py: torch.optim.Muon's update (its matrices one at a time, a float LR) from a batched
    step whose LR may be a device tensor (what a CUDA graph replays); wide, tall and square matrices."""
    from hydra_lm.train.muon import Muon

    torch.manual_seed(0)
    shapes = [(24, 40), (24, 40), (40, 24), (16, 16), (40, 24)]
    start = [torch.randn(s) for s in shapes]
    runs = {}
    for name in ("torch", "float", "tensor"):
        params = [torch.nn.Parameter(p.clone()) for p in start]
        if name == "torch":
            opt = torch.optim.Muon(params, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
        else:
            opt = Muon(params, lr=0.02 if name == "float" else torch.tensor(0.02), weight_decay=0.1)
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
        runs[name] = [p.detach() - s for p, s in zip(params, start)]  # what the three steps moved
    for ours, ref in zip(runs["float"], runs["torch"]):
        # The steps move weights by ~0.03. Batched and one-at-a-time bf16 products may round differently, and
        # on the CPU ours are fp32 sums rounded once (muon._baddbmm) where torch's bf16 kernel rounds its own
        # way: up to about one bf16 step (2^-8) of the largest move.
        assert torch.allclose(ours, ref, rtol=0, atol=ref.abs().max().item() * 2 ** -8)
        assert ref.abs().max() > 0.01  # the steps moved the weights
    for a, b in zip(runs["tensor"], runs["float"]):  # the LR's products in fp32 rather than double
        assert torch.allclose(a, b, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="2-D"):
        Muon([torch.nn.Parameter(torch.zeros(3))], lr=0.1)


@pytest.mark.parametrize("clip", [0.05, 1e6])
def test_clipping_inside_the_fused_update_gives_clip_grad_norm_s_step(clip):
    """With torch's fused AdamW the step's clipping factor rides on the update (``grad_scale``): the same
    parameters and norm as ``clip_grad_norm_`` followed by the unfused update, clipping or not."""
    from hydra_lm.train.compile_policy import SpeedPlan
    from hydra_lm.train.step import TrainStep

    plan = SpeedPlan(None, False, "naive", 4096)
    results = []
    for fused in (True, False):
        model = tiny_model().double()
        for i, p in enumerate(model.parameters()):
            p.grad = torch.randn(p.shape, dtype=p.dtype, generator=torch.Generator().manual_seed(i))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
        step = TrainStep(model, model, optimizer, torch.device("cpu"), plan, grad_clip=clip)
        assert step.clip_in_update == fused
        norm = step.update()
        results.append((norm, [p.detach().clone() for p in model.parameters()]))
    torch.testing.assert_close(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-9)  # the fused update's scale is fp32
    # an optimizer handed on to a step that does not clip in its update keeps no factor from the last one
    reused = torch.optim.AdamW(model.parameters(), fused=True)
    TrainStep(model, model, reused, torch.device("cpu"), plan, grad_clip=clip).update()
    assert reused.grad_scale is not None
    assert not TrainStep(model, model, reused, torch.device("cpu"), plan, grad_clip=0.0).clip_in_update
    assert reused.grad_scale is None
