"""Config validation, presets and the info command."""

import pytest
import torch

import hydra_lm
import hydra_lm.cli
from hydra_lm.config import PRESETS, HydraConfig, preset_config
from hydra_lm.model import HydraModel
from hydra_lm.model import accounting
from hydra_lm.model.accounting import count_parameters, executed_flops_per_token


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_parameter_counts_are_within_25_percent_of_the_advertised_ones(name):
    cfg = preset_config(name)
    with torch.device("meta"):
        model = HydraModel(cfg)
    total = count_parameters(model).total
    advertised = PRESETS[name]["advertised_params"]
    assert abs(total - advertised) / advertised < 0.25, total
    assert cfg.head_dim in (32, 64), "latent heads sized for tensor cores"


@pytest.mark.parametrize("overrides, field", [
    (dict(dim=510), "compression_factor"),
    (dict(mod_capacity=0.0), "mod_capacity"),
    (dict(mod_capacity=1.5), "mod_capacity"),
    (dict(n_kv_heads=3), "n_kv_heads"),
    (dict(n_heads=3, n_kv_heads=1), "n_heads"),
    (dict(dim=56, n_heads=2, n_kv_heads=1), "head_dim"),
    (dict(recursions=0), "recursions"),
    (dict(arch="rnn"), "arch"),
    (dict(sharing="random"), "sharing"),
    (dict(mor_routing="soft"), "mor_routing"),
    (dict(moe=True, moe_top_k=5), "moe_top_k"),
    (dict(moe=True, moe_num_experts=1, moe_top_k=1), "moe_num_experts"),  # a router over one expert never learns
    (dict(moe=True, moe_num_layers=2), "moe_num_layers"),
    (dict(moe=True, moe_num_layers=1, mlp_hidden=100), "moe_hidden"),  # the grouped GEMM's 16-byte rows
    (dict(sharing="middle_cycle"), "n_blocks"),
    (dict(sharing="middle_cycle", n_blocks=4, mod_every=2), "mod_every"),
    (dict(rope_theta=0.0), "rope_theta"),
    (dict(norm_eps=-1.0), "norm_eps"),
    (dict(init_std=-1.0), "init_std"),
    (dict(mor_gate_scale=float("inf")), "mor_gate_scale"),
    (dict(mod_aux_weight=float("nan")), "mod_aux_weight"),
    (dict(n_blocks=1), "mod_every"),  # MoD every 2nd block of one: no router, though MoD is on
    (dict(n_blocks=2, mod_every=3), "mod_every"),
    (dict(mod_first_block=True), "mod_first_block"),  # with mod_every=2 it never routes the first block
    (dict(head_dim=8.0), "head_dim"),
    (dict(mod_capacity="0.5"), "mod_capacity"),
])
def test_invalid_values_raise_value_errors_that_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=f"HydraConfig.{field}="):
        preset_config("debug", **overrides)


@pytest.mark.parametrize("overrides, message", [
    (dict(n_blocks=1), "mod_every=2: routes none of the 1 block.*: set mod_first_block=True with mod_every=1"),
    (dict(n_blocks=2, mod_every=3), "mod_every=3: routes none of the 2 block.*: lower mod_every to at most 2"),
    (dict(n_heads=256, n_kv_heads=1), r"n_heads=256: must divide the query latent dim/compression_factor=128 .*"
                                      r"try one of \[1, 2, 4, 8, 16, 32, 64\]$"),
    (dict(n_heads=3, n_kv_heads=1), r"n_heads=3: must divide the query latent dim/compression_factor=128 .*"
                                    r"try one of \[1, 2, 4, 8, 16, 32, 64\]$"),  # no head_dim: none would fit
    (dict(dim=4, compression_factor=8), "compression_factor=8: must divide dim=4"),
    (dict(head_dim=16), "head_dim=16: n_heads\\*head_dim=4\\*16 must equal .*=128: set head_dim=32 or leave it unset"),
    (dict(arch="dense", n_heads=3, n_kv_heads=1), "n_heads=3: must divide dim=512 for the dense baseline"),
    (dict(arch="dense", dim=33, n_heads=2, n_kv_heads=1), "n_heads=2: .*no head count can, as the width is odd"),
    # n_heads first: advice on n_kv_heads alone (1 or 3) would lead to the error above
    (dict(n_heads=3), r"n_heads=3: must divide the query latent"),
], ids=["one_block", "mod_every_past_the_blocks", "more_heads_than_latent", "heads_not_dividing_latent",
        "compression_past_dim", "head_dim_set", "dense_heads", "odd_width", "heads_before_kv_heads"])
def test_layout_errors_name_the_field_to_change_and_a_value_that_works(overrides, message):
    with pytest.raises(ValueError, match=f"^HydraConfig.{message}"):
        HydraConfig(**overrides)


@pytest.mark.parametrize("dim, heads", [(512, 8), (256, 4), (1000, 20)])
def test_the_dense_presets_heads_follow_a_dim_override(dim, heads):
    cfg = preset_config("debug", arch="dense", dim=dim)
    assert (cfg.n_heads, cfg.n_kv_heads) == (heads, max(1, heads // 4))  # the rest validate() enforces


def test_a_copy_with_other_sizes_derives_its_heads_mlp_and_depth_again_unless_they_were_set():
    small = HydraConfig(vocab_size=128, dim=64, n_heads=2, n_kv_heads=1)
    fresh = HydraConfig(vocab_size=128, dim=128, n_heads=4, n_kv_heads=1)
    for copy in (small.replace(dim=128, n_heads=4), hydra_lm.create_model(small, dim=128, n_heads=4).config,
                 hydra_lm.create_model(small.to_dict(), dim=128, n_heads=4).config):
        assert (copy.head_dim, copy.mlp_hidden, copy.moe_hidden) == (fresh.head_dim, fresh.mlp_hidden, fresh.moe_hidden)
    assert small.replace(mlp_hidden=1024).moe_hidden == 1024
    dense = HydraConfig(arch="dense", vocab_size=128, dim=64, n_heads=2, n_kv_heads=1)
    assert dense.replace(n_blocks=4).n_layers == 4
    chosen = HydraConfig(vocab_size=128, dim=64, n_heads=2, n_kv_heads=1, mlp_hidden=100, n_blocks=3)
    assert chosen.replace(dim=128, n_heads=4).mlp_hidden == 100  # set by the user: kept


def test_saved_configs_that_built_no_mod_router_load_as_built():
    """Refused today, a config whose MoD routed no block was built (and saved) with MoD off in effect."""
    built = HydraConfig(vocab_size=128, dim=64, n_heads=2, n_kv_heads=1, n_blocks=1, mod_enabled=False).to_dict()
    assert not HydraConfig.from_saved({**built, "mod_enabled": True}).mod_enabled
    every_2nd = HydraConfig(vocab_size=128, dim=64, n_heads=2, n_kv_heads=1).to_dict()
    assert not HydraConfig.from_saved({**every_2nd, "mod_first_block": True}).mod_first_block


def test_unknown_keys_and_presets_are_rejected_with_suggestions():
    with pytest.raises(ValueError, match="did you mean mod_capacity"):
        hydra_lm.create_model("debug", mod_capacityy=0.5)
    with pytest.raises(ValueError, match="unknown preset '7B'"):
        hydra_lm.create_model("7B")
    with pytest.raises(ValueError, match="unknown HydraConfig key"):
        HydraConfig.from_dict({"dim": 64, "colour": "blue"})


def test_routing_cuts_executed_flops():
    cfg = preset_config("100M")
    routed = executed_flops_per_token(cfg, 1024)
    full = executed_flops_per_token(cfg.replace(mod_enabled=False, mor_enabled=False), 1024)
    assert full / routed > 1.5


@pytest.mark.parametrize("overrides", [{}, {"static_routing_mode": True}, {"mor_routing": "token"},
                                       {"arch": "dense", "n_layers": 3}], ids=["topk", "static", "token", "dense"])
def test_executed_flops_are_the_matmuls_the_model_runs(overrides):
    """The count's matmuls (attention's left out: FlopCounterMode sees the kernels' full squares, not the causal
    half) are what a forward executes; static routing runs every token through every unit."""
    from torch.utils.flop_counter import FlopCounterMode

    seq_len = 256
    model = hydra_lm.create_model("debug", vocab_size=1000, dim=128, n_heads=2, n_kv_heads=1, max_seq_len=seq_len,
                                  **overrides)
    counter = FlopCounterMode(display=False)
    with counter:
        model(torch.randint(0, 1000, (2, seq_len)))
    measured = sum(n for op, n in counter.get_flop_counts()["Global"].items() if "attention" not in str(op))
    cfg = model.config
    attention = sum(n_layers * k * 4 * cfg.n_heads * cfg.head_dim * (k + 1) / 2
                    for _, n_layers, k in accounting.unit_token_counts(cfg, seq_len))
    counted = executed_flops_per_token(cfg, seq_len, training=False) * seq_len - attention
    assert measured / 2 == pytest.approx(counted, rel=0.02)  # 2 rows


def test_info_command_prints_the_promised_facts(capsys):
    assert hydra_lm.cli.main(["info", "--model_size", "100M"]) == 0
    text = capsys.readouterr().out
    for needle in ("non-embedding", "effective", "32 effective layers", "FLOPs per token", "KV cache", "heads x 32"):
        assert needle in text
    assert hydra_lm.cli.main(["info", "--model_size", "7B"]) == 2


def test_the_mod_router_loss_weight_is_the_formula_floored_at_its_100m_value():
    """max(0.01, 0.01 * (L/32) * sqrt(dim/768)): small models keep a router loss strong enough for the causal
    rule (benchmarks/BENCHMARKS.md, twentieth session); large ones scale up; an explicit value wins."""
    weights = {name: preset_config(name).resolved_mod_aux_weight for name in ("debug", "50M", "100M", "1B")}
    assert weights["debug"] == weights["50M"] == weights["100M"] == pytest.approx(0.01)
    assert weights["1B"] == pytest.approx(0.01 * 80 / 32 * (1792 / 768) ** 0.5)
    assert preset_config("debug", mod_aux_weight=0.002).resolved_mod_aux_weight == 0.002


def test_mod_first_block_with_middle_cycle_is_refused_and_an_old_config_of_it_loads_as_built():
    """middle_cycle's first layer is unshared and never routed: mod_first_block did nothing there, silently. Configs
    saved before with mod_every=1 (which then meant the first block too) still load, as the model they built."""
    with pytest.raises(ValueError, match="middle_cycle's first layer is unshared and never routed"):
        preset_config("debug", sharing="middle_cycle", n_blocks=4, mod_every=1, mod_first_block=True)
    saved = preset_config("debug", sharing="middle_cycle", n_blocks=4, mod_every=1).to_dict()
    saved.pop("mod_first_block")
    assert HydraConfig.from_saved(saved).mod_first_block is False
