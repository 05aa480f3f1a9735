"""MoE in the trainer: flag aliases of the model fields, per-part LR/WD groups, router warm-up, expert load."""

import json

import pytest
import torch
from safetensors.torch import load_file

import hydra_lm
from hydra_lm.cli import main
from hydra_lm.config import HydraConfig
from hydra_lm.train.moe_training import MOE_ROUTER, expert_load_record, hold_routers
from hydra_lm.train.optim import build_optimizer, make_capturable, set_lr
from hydra_lm.train.options import TrainConfig
from support import TINY_RUN, records

MOE = ["--moe", "--moe_num_experts", "4", "--moe_top_k", "2", "--moe_num_layers", "1"]


def _moe_groups(**scales):
    model = hydra_lm.create_model("debug", vocab_size=97, dim=64, n_heads=2, n_kv_heads=1, mlp_hidden=96, moe=True)
    opt = build_optimizer(model, TrainConfig(lr=1e-3, weight_decay=0.1, **scales), torch.device("cpu"))
    group_of = {id(p): g for g in opt.param_groups for p in g["params"]}
    moe = next(iter(model.moe_blocks.values()))
    main_group = group_of[id(model.blocks[0].layers[0].mlp_norm.weight)]
    return opt, group_of[id(moe.router.weight)], group_of[id(moe.w_gate_up)], main_group


def test_groups_scale_lr_and_decay_per_part_and_the_router_can_be_held():
    opt, router, expert, _ = _moe_groups(moe_router_lr_scale=0.5, moe_expert_lr_scale=2.0, moe_expert_wd_scale=0.0)
    assert router[MOE_ROUTER] and router["lr_ratio"] == 0.5 and router["weight_decay"] == 0.1
    assert expert["lr_ratio"] == 2.0 and expert["weight_decay"] == 0.0 and not expert.get(MOE_ROUTER)
    set_lr(opt, 1e-3)
    hold_routers(opt)
    assert router["lr"] == 0.0 and expert["lr"] == 2e-3
    set_lr(opt, 1e-3)
    assert router["lr"] == 5e-4


def test_a_new_optimizer_runs_each_group_at_its_lr_ratio():
    """Before any set_lr (the one-call setup calls none): each group at lr x its ratio, a captured one too."""
    opt, router, expert, main_group = _moe_groups(moe_router_lr_scale=0.5, moe_expert_lr_scale=2.0)
    assert (router["lr"], expert["lr"], main_group["lr"]) == (5e-4, 2e-3, 1e-3)
    make_capturable(opt, torch.device("cpu"))
    assert [g["lr"].item() for g in (router, expert, main_group)] == pytest.approx([5e-4, 2e-3, 1e-3])


def test_holding_the_routers_of_a_graph_captured_optimizer_leaves_the_other_groups_learning():
    # Captured updates read each group's LR from a device tensor shared by the groups of one LR ratio; the
    # routers' default ratio is everyone's, so a shared tensor zeroed for them would freeze the whole model.
    opt, router, expert, main_group = _moe_groups()
    make_capturable(opt, torch.device("cpu"))
    assert router["lr_ratio"] == expert["lr_ratio"] == main_group["lr_ratio"] == 1.0
    set_lr(opt, 1e-3)
    hold_routers(opt)
    assert router["lr"].item() == 0.0
    assert expert["lr"].item() == main_group["lr"].item() == pytest.approx(1e-3)


def test_starving_experts_are_reported():
    record, warnings = expert_load_record(torch.tensor([[0.97, 0.01, 0.01, 0.01], [0.25, 0.25, 0.3, 0.2]]),
                                          ["after_block0", "after_block1"])
    assert record["after_block1"] == [0.25, 0.25, 0.3, 0.2]
    assert sorted(warnings) == ["after_block0/1", "after_block0/2", "after_block0/3"]
    assert "expert 1 receives 0.0100" in warnings["after_block0/1"]


def test_moe_run_freezes_routers_during_warm_up_and_logs_expert_load(tiny_data, tmp_path):
    run = tmp_path / "run"
    assert main(["train", "--data", str(tiny_data), "--out", str(run), *TINY_RUN, *MOE, "--max_steps", "2",
                 "--moe_warmup_steps", "2", "--log_every", "1", "--no-eval_at_start", "--eval_every", "0"]) == 0
    model_cfg = json.loads((run / "config.json").read_text())["model"]
    assert (model_cfg["moe"], model_cfg["moe_num_experts"], model_cfg["moe_top_k"]) == (True, 4, 2)
    loads = [r["moe_expert_load"] for r in records(run, "train")]
    assert len(loads) == 2 and all(abs(sum(shares) - 1) < 1e-3 for rec in loads for shares in rec.values())
    torch.manual_seed(0)  # the trainer's initialisation
    initial = hydra_lm.create_model(HydraConfig(**model_cfg)).state_dict()
    trained = load_file(str(run / "checkpoints" / "hydra_debug_step2" / "model.safetensors"))
    routers = [k for k in trained if k.startswith("moe_blocks.") and ".router." in k]
    assert routers and all(torch.equal(trained[k], initial[k]) for k in routers)
    assert not torch.equal(trained["moe_blocks.0.w_gate_up"], initial["moe_blocks.0.w_gate_up"])


def test_a_resumed_run_continues_the_expert_load_window(tiny_data, tmp_path):
    common = ["--data", str(tiny_data), *TINY_RUN, *MOE, "--max_steps", "4", "--log_every", "4", "--save_every", "2",
              "--no-eval_at_start", "--eval_every", "0"]
    assert main(["train", "--out", str(tmp_path / "straight"), *common]) == 0
    assert main(["train", "--out", str(tmp_path / "pieces"), *common, "--stop_at_step", "2"]) == 0
    assert main(["train", "--out", str(tmp_path / "pieces")]) == 0
    straight, pieces = (next(r for r in records(tmp_path / run, "train") if r["step"] == 4)
                        for run in ("straight", "pieces"))
    assert pieces["loss"] == straight["loss"] and pieces["moe_expert_load"] == straight["moe_expert_load"]


@pytest.mark.parametrize("extra, message", [
    (["--arch", "dense", "--moe"], "--moe: MoE layers belong to the hydra architecture"),
    (["--arch", "dense", "--moe_router_lr_scale", "0.5"], "--moe_router_lr_scale: MoE layers belong"),
    (["--moe_warmup_steps", "3"], "--moe_warmup_steps tune MoE layers, which this model has none of: add --moe"),
    (["--moe", "--model.moe", "false"], "moe is given both as --moe and as model.moe"),
])
def test_bad_moe_settings_fail_with_one_line(tiny_data, tmp_path, capsys, extra, message):
    code = main(["train", "--data", str(tiny_data), "--out", str(tmp_path / "run"), "--max_steps", "2", *TINY_RUN,
                 *extra])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.startswith("hydra-lm train: error:") and err.count("\n") == 1

