"""The experimental and alias flags: one-line refusals, what reaches the model, the FA3 report, the FP8 filter."""

import json

import pytest

import hydra_lm
from hydra_lm.cli import main
from hydra_lm.train.fp8 import convertible
from support import TINY_RUN


@pytest.mark.parametrize("extra, message", [
    (["--dataset", "default"], "--data and --dataset both name the training data"),
    (["--cuda_graphs_warmup", "3"], "--cuda_graphs_warmup sets the eager steps before a CUDA graph capture, and "
                                    "this run captures none"),
    (["--experimental_cuda_graphs"], "--cuda_graph needs a CUDA device"),
    (["--experimental_fp8"], "--experimental_fp8 needs a CUDA GPU of compute capability 9.0+ (Hopper); this run is "
                             "on cpu"),
    (["--experimental_fp8", "--fp8_format", "e5m2"], "--fp8_recipe rowwise_with_gw_hp casts the output gradients to "
                                                     "e4m3 (torchao's recipe): drop --fp8_format e5m2"),
])
def test_bad_settings_fail_with_one_line(tiny_data, tmp_path, capsys, extra, message):
    code = main(["train", "--data", str(tiny_data), "--out", str(tmp_path / "run"), "--max_steps", "2", *TINY_RUN,
                 *extra])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.startswith("hydra-lm train: error:") and err.count("\n") == 1


def test_alias_flags_reach_the_model_and_fa3_is_reported(tiny_data, tmp_path):
    run = tmp_path / "run"
    assert main(["train", "--data", str(tiny_data), "--out", str(run), *TINY_RUN, "--max_steps", "1",
                 "--static_routing_mode", "--experimental_fa3", "--no-eval_at_start", "--eval_every", "0"]) == 0
    assert json.loads((run / "config.json").read_text())["model"]["static_routing_mode"] is True
    assert "--experimental_fa3: this torch" in (run / "train.log").read_text()


def test_fp8_converts_only_the_layers_linears_with_dims_divisible_by_16():
    model = hydra_lm.create_model("debug", vocab_size=97, dim=64, n_heads=2, n_kv_heads=1, mlp_hidden=96, moe=True)
    chosen = {name for name, m in model.named_modules() if convertible(m, name)}
    assert chosen and all(name.startswith("blocks.") and ".layers." in name for name in chosen)
    assert not any("router" in name for name in chosen)
    assert any(name.endswith("mlp.gate_up") for name in chosen)


def test_each_fp8_format_casts_the_output_gradients_to_its_own_dtype(monkeypatch):
    """Under the tensorwise recipe e5m2 gives the output gradients e5m2, e4m3 (the default) gives them e4m3; the
    forward is e4m3 in both. torchao's default config would run e5m2 gradients for both names."""
    pytest.importorskip("torchao")
    import torch

    from hydra_lm.train import fp8
    from hydra_lm.train.options import TrainConfig

    monkeypatch.setattr(fp8, "check_fp8_device", lambda device: None)
    assert (TrainConfig().fp8_format, TrainConfig().fp8_recipe) == ("e4m3", "rowwise_with_gw_hp")
    for fmt, grad_dtype in (("e5m2", torch.float8_e5m2), ("e4m3", torch.float8_e4m3fn)):
        model = hydra_lm.create_model("debug", vocab_size=97, dim=64, n_heads=2, n_kv_heads=1, mlp_hidden=96)
        assert fp8.convert_to_fp8(model, fmt, torch.device("cpu"), recipe="tensorwise") > 0
        configs = [m.config for m in model.modules() if hasattr(m, "min_tokens")]
        assert configs and all(c.cast_config_grad_output.target_dtype == grad_dtype for c in configs)
        assert all(c.cast_config_input.target_dtype == c.cast_config_weight.target_dtype == torch.float8_e4m3fn
                   for c in configs)
    with pytest.raises(ValueError, match="fp8_format 'e3m4'"):
        fp8.convert_to_fp8(model, "e3m4", torch.device("cpu"))


def test_fp8_rowwise_recipes_scale_per_row_and_need_e4m3_gradients(monkeypatch):
    pytest.importorskip("torchao")
    import torch
    from torchao.float8.config import ScalingGranularity, ScalingType

    from hydra_lm.train import fp8

    monkeypatch.setattr(fp8, "check_fp8_device", lambda device: None)
    for recipe, weight_grad_in_float8 in (("rowwise", True), ("rowwise_with_gw_hp", False)):
        model = hydra_lm.create_model("debug", vocab_size=97, dim=64, n_heads=2, n_kv_heads=1, mlp_hidden=96)
        assert fp8.convert_to_fp8(model, "e4m3", torch.device("cpu"), recipe=recipe) > 0
        layers = [m for m in model.modules() if hasattr(m, "min_tokens")]
        assert all(m.config.cast_config_input.scaling_granularity is ScalingGranularity.AXISWISE and
                   m.config.pad_inner_dim for m in layers)
        # the weight gradient's GEMM: its operands in float8, or (gw_hp) left in high precision
        assert all((m.config.cast_config_grad_output_for_grad_weight.scaling_type is not ScalingType.DISABLED)
                   == weight_grad_in_float8 for m in layers)
        assert all(m.config.cast_config_grad_output.target_dtype == torch.float8_e4m3fn for m in layers)
        x = torch.randn(2, 16, 64)
        model.blocks[0].layers[0].mlp(x).square().sum().backward()  # float8 GEMMs on the CPU, forward and back
    with pytest.raises(ValueError, match="drop --fp8_format e5m2"):
        fp8.convert_to_fp8(model, "e5m2", torch.device("cpu"), recipe="rowwise")


def test_fp8_layers_run_calls_under_the_token_gate_in_high_precision_and_the_rest_in_float8(monkeypatch):
    """A routed depth's few tokens skip float8's casts; the whole batch's call goes through float8 (on a
    CPU too: torch runs float8 GEMMs there, slowly, so the Hopper check is lifted), with gradients either way."""
    pytest.importorskip("torchao")
    import torch
    import torch.nn.functional as F

    from hydra_lm.train import fp8

    monkeypatch.setattr(fp8, "check_fp8_device", lambda device: None)
    torch.manual_seed(0)
    model = hydra_lm.create_model("debug", vocab_size=97, dim=64, n_heads=2, n_kv_heads=1, mlp_hidden=96)
    expected = sum(convertible(m, name) for name, m in model.named_modules())
    assert fp8.convert_to_fp8(model, "e4m3", torch.device("cpu"), min_tokens=32) == expected
    layer = next(m for name, m in model.named_modules() if name.endswith("mlp.gate_up"))
    for tokens, in_float8 in ((31, False), (32, True)):
        x = torch.randn(1, tokens, 64, requires_grad=True)
        out = layer(x)
        reference = F.linear(x, layer.weight, layer.bias)
        if in_float8:  # quantised: close to the full-precision product, not equal to it
            assert not torch.equal(out, reference)
            assert (out - reference).norm() < 0.1 * reference.norm()
        else:
            assert torch.equal(out, reference)
        out.square().sum().backward()
        assert torch.isfinite(layer.weight.grad).all() and layer.weight.grad.abs().sum() > 0
        layer.weight.grad = None


def test_a_run_saved_before_fp8_recipes_existed_resumes_with_the_scaling_it_trained_with():
    """Such a run trained tensorwise (with e5m2 or e4m3 gradients): resuming it must not switch to the new
    default recipe, which would also refuse its saved e5m2."""
    from hydra_lm.train.fp8 import check_fp8_setting
    from hydra_lm.train.run import merge_layers

    old = merge_layers({}, {}, {"experimental_fp8": True, "fp8_format": "e5m2"})
    assert (old.fp8_recipe, old.fp8_format) == ("tensorwise", "e5m2")
    check_fp8_setting(old.fp8_format, old.fp8_recipe)
    assert merge_layers({}, {}, {"experimental_fp8": True, "fp8_recipe": "rowwise"}).fp8_recipe == "rowwise"
    assert merge_layers({}, {}, None).fp8_recipe == "rowwise_with_gw_hp"
