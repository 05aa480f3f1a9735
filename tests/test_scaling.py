"""`hydra-lm scaling`: the power-law fit, the frontier of each family, and which runs pool as seeds."""

import json

import numpy as np
import pytest

from hydra_lm.cli import main
from hydra_lm.diagnostics.scaling import fit_power_law, load_points

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_scaling_fit_recovers_a_known_law_and_compares_compute(tmp_path, capsys):
    c = np.geomspace(1e12, 1e15, 10)
    fit = fit_power_law(c, 3e3 * c ** -0.3 + 1.8)
    assert fit["a"] == pytest.approx(3e3, rel=1e-3) and fit["b"] == pytest.approx(0.3, rel=1e-3)
    assert fit["c"] == pytest.approx(1.8, abs=1e-4) and fit["rmse"] < 1e-4
    noisy = 3e3 * c ** -0.3 + 1.8 + np.random.default_rng(0).normal(0, 0.003, c.size)
    noisy_fit = fit_power_law(c, noisy)
    assert noisy_fit["b"] == pytest.approx(0.3, abs=0.05) and 0.001 < noisy_fit["rmse"] < 0.005  # the noise's size
    with pytest.raises(ValueError, match="at least 4"):
        fit_power_law([1e12, 1e13, 1e14, 1e14], [3.0, 2.5, 2.2, 2.2])

    # Dense needs exactly twice HYDRA's compute for any loss: L_dense(C) = L_hydra(C / 2).
    law = lambda x: 3e3 * x ** -0.3 + 1.8  # noqa: E731
    for name, factor in (("small", 1.0), ("big", 10.0)):
        evals = lambda f, factor=factor: [{"step": i, "flops": x, "val_loss_causal": law(x / f)}  # noqa: E731
                                          for i, x in enumerate(c[:5] * factor)]
        variants = {"hydra": {"arch": "hydra", "evals": evals(1.0)}, "dense": {"arch": "dense", "evals": evals(2.0)}}
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps({"variants": variants}))
    assert main(["scaling", "--results", str(tmp_path / "small"), str(tmp_path / "big"), "--predict", "1e16",
                 "--bootstrap", "20", "--out", str(tmp_path / "fit")]) == 0
    printed = capsys.readouterr().out
    assert "dense needs 2x the compute" in printed
    summary = json.loads((tmp_path / "fit" / "scaling.json").read_text())
    hydra = summary["groups"]["hydra"]
    assert hydra["multiplier"] == pytest.approx(2.0, rel=0.01) and hydra["loss"] == pytest.approx(law(1e16), abs=1e-3)
    assert hydra["multiplier_interval_68"][0] <= 2.0 + 1e-6 <= hydra["multiplier_interval_68"][1] + 2e-6
    assert (tmp_path / "fit" / "scaling.png").read_bytes().startswith(PNG_SIGNATURE)

    few = tmp_path / "few"
    few.mkdir()
    pts = [{"flops": x, "val_loss_causal": law(x)} for x in c[:3]]
    (few / "results.json").write_text(json.dumps({"variants": {"hydra": {"arch": "hydra", "evals": pts}}}))
    assert main(["scaling", "--results", str(few)]) == 2
    err = capsys.readouterr().err
    assert "cannot fit hydra" in err and "at least 4" in err and err.count("\n") == 1


def test_scaling_fits_each_familys_frontier_with_the_seeds_of_a_variant_averaged(tmp_path, capsys):
    from hydra_lm.diagnostics.scaling import frontier

    assert frontier([3.0, 1.0, 2.0, 2.0, 4.0], [1.5, 3.0, 2.0, 2.5, 1.6]) == ([1.0, 2.0, 3.0], [3.0, 2.0, 1.5])
    law = lambda x: 3e3 * x ** -0.3 + 1.8  # noqa: E731
    c = np.geomspace(1e12, 1e15, 6)

    def run(arch, loss, variant, seed=0):
        return {"variant": variant, "seed": seed, "arch": arch,
                "evals": [{"step": i, "flops": x, "val_loss_causal": loss(x)} for i, x in enumerate(c)]}
    # Each family: a variant on its law (HYDRA's over seeds whose noise cancels) and a worse setting of it.
    # Dense needs twice HYDRA's compute for any loss: L_dense(C) = L_hydra(C / 2).
    experiment = {"budget": {"kind": "flops", "value": 1e15}, "settings": {"seed": 0, "batch_size": 8}}
    first = {"good.seed0": run("hydra", lambda x: law(x) + 0.01, "good"),
             "good.seed1": run("hydra", lambda x: law(x) - 0.02, "good", 1),
             "badlr": run("hydra", lambda x: law(x) + 0.3, "badlr"),
             "d4": run("dense", lambda x: law(x / 2), "d4"), "d9": run("dense", lambda x: law(x / 2) + 0.2, "d9")}
    later = {"good.seed2": run("hydra", lambda x: law(x) + 0.01, "good", 2)}  # a seed run apart, same experiment
    for name, variants in (("first", first), ("later", later)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps({**experiment, "settings": {
            **experiment["settings"], "seed": 2 if name == "later" else 0}, "variants": variants}))
    dirs = [str(tmp_path / "first"), str(tmp_path / "later")]
    assert main(["scaling", "--results", *dirs, "--predict", "1e16", "--bootstrap", "0", "--out", str(tmp_path)]) == 0
    assert "dense needs 2x the compute" in capsys.readouterr().out
    hydra = json.loads((tmp_path / "scaling.json").read_text())["groups"]["hydra"]
    assert hydra["points"] == len(c) and hydra["b"] == pytest.approx(0.3, rel=1e-3)
    assert hydra["loss"] == pytest.approx(law(1e16), abs=1e-4)
    # Every run's points: the worse settings pull the fits, and the multiplier is no longer the laws'.
    assert main(["scaling", "--results", *dirs, "--predict", "1e16", "--bootstrap", "0", "--out", str(tmp_path),
                 "--points", "all"]) == 0
    capsys.readouterr()
    hydra = json.loads((tmp_path / "scaling.json").read_text())["groups"]["hydra"]
    assert hydra["points"] == 4 * len(c) and abs(hydra["multiplier"] - 2.0) > 0.1


def test_scaling_pools_a_seconds_budgets_seeds_only_on_one_device(tmp_path):
    """Two seeds of one variant at equal points: averaged when they share a device, kept apart otherwise
    (the frontier then keeps the lower run's points)."""
    c = [1e12, 1e13, 1e14]

    def seed_run(seed, device, shift):
        return {"variant": "good", "seed": seed, "arch": "hydra", "device": device,
                "evals": [{"step": i, "train_s": x, "val_loss_causal": 3.0 - i * 0.1 + shift} for i, x in enumerate(c)]}
    for devices, expected in ((("H100", "H100"), [3.0, 2.9, 2.8]), (("H100", "H200"), [2.9, 2.8, 2.7])):
        study = tmp_path / "_".join(devices)
        study.mkdir()
        (study / "results.json").write_text(json.dumps({
            "budget": {"kind": "seconds", "value": 60}, "settings": {"seed": [0, 1]},
            "variants": {"good.seed0": seed_run(0, devices[0], 0.1), "good.seed1": seed_run(1, devices[1], -0.1)}}))
        assert load_points([study], "seconds", "family")["hydra"]["y"] == pytest.approx(expected)


def test_a_seed_that_diverged_does_not_leave_the_averaged_curve_to_the_survivors(tmp_path):
    """Past the point where one seed diverged (its losses null), a mean of the survivors would drop exactly where
    the fit's floor is decided: those points are left out, as are those a seed never reached."""
    def seed_run(seed, losses):
        return {"variant": "good", "seed": seed, "arch": "hydra",
                "evals": [{"step": i, "flops": 10.0 ** (12 + i), "val_loss_causal": y} for i, y in enumerate(losses)]}
    study = tmp_path / "study"
    study.mkdir()
    (study / "results.json").write_text(json.dumps({
        "budget": {"kind": "flops", "value": 1e16}, "settings": {"seed": [0, 1, 2]},
        "variants": {"good.seed0": seed_run(0, [5.0, 4.0, 3.6, 3.4]), "good.seed1": seed_run(1, [5.2, 4.4, None, None]),
                     "good.seed2": seed_run(2, [5.1, 4.2, 3.8])}}))
    points = load_points([study], "flops", "family")["hydra"]
    assert points["y"] == pytest.approx([5.1, 4.2]) and points["x"] == pytest.approx([1e12, 1e13])
    assert len(load_points([study], "flops", "family", "all")["hydra"]["y"]) == 4 + 2 + 3
