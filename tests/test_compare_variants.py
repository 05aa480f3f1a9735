"""`hydra-lm compare --variant NAME:field=value,...`: fields a variant's model ignores, settings every variant
shares, and a variant that would train another one's run again are refused with a line that says what to change."""

import re

import pytest

from hydra_lm.diagnostics.compare import plan_compare
from hydra_lm.diagnostics.compare_runs import parse_budget
from hydra_lm.diagnostics.variants import parse_custom_variant

SHARED = {"model_size": "debug", "device": "cpu", "batch_size": 4, "seq_len": 32,
          "model": {"dim": 64, "n_heads": 2, "n_kv_heads": 1, "mlp_hidden": 128}}


@pytest.mark.parametrize("spec, message", [
    # HYDRA's depth is n_blocks x recursions: n_layers would give the preset under a new name.
    ("x:n_layers=4", "n_layers sets the depth of the dense baseline only (arch=dense)"),
    ("x:arch=hydra,n_layers=4", "n_layers sets the depth of the dense baseline only"),
    # The preset is shared: the field is informational and a variant's value was dropped.
    ("x:preset=50M", "pick the size for the whole compare with --model_size"),
    # The dense baseline has no routers, recursion or CCGQA attention.
    ("x:arch=dense,mod_capacity=0.5", "so mod_capacity would change nothing: drop it"),
    ("x:arch=dense,recursions=3,mor_capacity=0.5", "so recursions, mor_capacity would change nothing: drop them"),
    ("x:arch=dense,n_layers=3,mod_off=true", "so mod_off would change nothing"),
    ("x:arch=dense,compression_factor=2", "so compression_factor would change nothing"),
])
def test_a_field_the_variants_architecture_ignores_is_refused(spec, message):
    with pytest.raises(ValueError, match=f"^--variant x: .*{re.escape(message)}"):
        parse_custom_variant(spec)


def test_fields_that_do_change_the_model_are_kept():
    assert parse_custom_variant("d3:arch=dense,n_layers=3").overrides == {"arch": "dense", "n_layers": 3}
    assert parse_custom_variant("b4:n_blocks=4,recursions=1").overrides == {"n_blocks": 4, "recursions": 1}
    assert parse_custom_variant("d:arch=dense,dim=128,optimizer=lion").train == {"optimizer": "lion"}


def test_a_shared_trainer_setting_names_its_compare_flag_and_a_bad_value_only_its_type():
    with pytest.raises(ValueError) as err:
        parse_custom_variant("x:batch_size=8")
    text = str(err.value)
    assert text.startswith("--variant x: batch_size is a trainer setting every variant shares: set it once for the "
                           "whole compare with --batch_size;")
    assert "HydraConfig" not in text and "did you mean" not in text
    with pytest.raises(ValueError, match="with --seed, or --seeds S1 S2 ... for several"):
        parse_custom_variant("x:seed=3")
    with pytest.raises(ValueError, match="max_steps is set by compare from --budget .* budget_scale=F"):
        parse_custom_variant("x:max_steps=5")
    # A value of the wrong type: its field and type, not the list of settings an unknown key gets.
    with pytest.raises(ValueError) as err:
        parse_custom_variant("x:mod_capacity=abc")
    assert str(err.value) == "--variant x: HydraConfig.mod_capacity='abc' must be a number"
    with pytest.raises(ValueError, match="did you mean mod_capacity.*curriculum settings"):
        parse_custom_variant("x:mod_capacty=0.5")


def test_a_custom_variant_that_trains_another_variants_run_again_is_refused_naming_both(tiny_data, tmp_path):
    def plan(names, customs):
        return plan_compare(str(tiny_data), str(tmp_path / "cmp"), parse_budget("tokens=1k"), names, customs, 2,
                            SHARED)
    depth = plan(["dense"], []).runs[0].model_cfg.n_layers
    for names, custom, other in ((["hydra"], "x:mod_capacity=0.125", "variant hydra"),  # the preset's own value
                                 (["dense"], f"x:arch=dense,n_layers={depth}", "variant dense"),
                                 (["vanilla"], "x:mod_enabled=false,mor_enabled=false", "variant vanilla"),
                                 (["hydra"], "y:mod_capacity=0.5", "--variant x")):
        customs = [custom] if custom.startswith("x") else ["x:mod_capacity=0.5", custom]
        with pytest.raises(ValueError, match=f"--variant [xy] trains the same model with the same settings as "
                                             f"{other} .*drop one of them, or change a field"):
            plan(names, customs)
    # Another share of the budget, or another depth, is another run.
    runs = plan(["hydra", "dense"], ["h:budget_scale=0.5", f"d:arch=dense,n_layers={depth + 1}"]).runs
    assert [r.name for r in runs] == ["hydra", "dense", "h", "d"]
