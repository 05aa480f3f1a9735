"""Loading a trained run for `generate`, `eval` and `export`: what a run's checkpoint must match, per-row sampling
seeds, kernel settings the device cannot run."""

import json

import pytest

from hydra_lm.cli import main
from support import TINY_RUN, rewrite_state


@pytest.fixture(scope="module")
def two_steps(tiny_data, tmp_path_factory):
    """A run of two steps with one checkpoint, to load and sample from; tests that change it change a copy."""
    run = tmp_path_factory.mktemp("two_steps") / "run"
    assert main(["train", "--data", str(tiny_data), "--out", str(run), *TINY_RUN, "--max_steps", "2"]) == 0
    return run


def test_sampled_prompts_of_a_batch_get_what_each_gets_alone_with_its_seed(two_steps):
    from hydra_lm.infer import generate_text

    sample = dict(max_new_tokens=12, temperature=1.0, top_k=None, device="cpu")
    batch = generate_text(two_steps, ["the quick", "a", "a"], seed=3, **sample)
    alone = [generate_text(two_steps, prompt, seed=seed, **sample) for prompt, seed in (("the quick", 3), ("a", 4))]
    assert batch[:2] == alone
    assert batch[1] != batch[2]  # the same prompt twice: two samples, seeds 4 and 5


def test_seeds_past_64_bits_wrap_as_a_generator_takes_a_negative_one(two_steps, capsys):
    """Prompt i's seed + i past 2**64 - 1 overflowed the generator ("Overflow when unpacking long long"): seeds are
    taken modulo 2**64, as torch takes -1 for 2**64 - 1, so each prompt still gets what it gets alone."""
    from hydra_lm.infer import generate_text

    sample = dict(max_new_tokens=12, temperature=1.0, top_k=None, device="cpu")
    batch = generate_text(two_steps, ["the quick", "a"], seed=2**64 - 1, **sample)
    alone = [generate_text(two_steps, "the quick", seed=-1, **sample), generate_text(two_steps, "a", seed=0, **sample)]
    assert batch == alone
    assert generate_text(two_steps, "a", seed=2**64, **sample) == batch[1]
    assert main(["generate", "--run", str(two_steps), "--prompt", "a", "--prompt", "b", "--seed", str(2**64 - 1),
                 "--max_new_tokens", "4", "--device", "cpu"]) == 0
    assert "sample 2 of 2" in capsys.readouterr().out


@pytest.mark.parametrize("field, value, message", [
    (("data", "tokenizer_fingerprint"), "0" * 64, "was trained with another tokenizer than run .*: pass the --run it "
                                                  "came from"),
    (("curriculum", "mor_ramp"), 2.0, r"records a malformed curriculum \(mor_ramp=2.0 must lie in \[0, 1\]"),
], ids=["tokenizer", "mor_ramp"])
def test_a_checkpoint_that_does_not_fit_its_run_is_refused(two_steps, tmp_path, field, value, message):
    """A checkpoint taken from another run (or from before the state's own hash, edited) is whole: its records must
    still be checked."""
    import shutil

    from hydra_lm.infer import load_run

    copy = shutil.copytree(two_steps / "checkpoints" / "hydra_debug_step2", tmp_path / "copy")
    assert load_run(two_steps, copy, "cpu").checkpoint.step == 2
    rewrite_state(copy, lambda state: state[field[0]].update({field[1]: value}))
    with pytest.raises(ValueError, match=message):
        load_run(two_steps, copy, "cpu")


def test_a_kernel_the_run_saved_that_this_device_cannot_run_falls_back_to_auto(two_steps, tmp_path, monkeypatch,
                                                                               capsys):
    import shutil

    import torch
    from safetensors import safe_open

    from hydra_lm.config import HydraConfig
    from hydra_lm.model import attention_backend
    from hydra_lm.model.attention import kernels_for_device

    run = shutil.copytree(two_steps, tmp_path / "run")
    config = json.loads((run / "config.json").read_text())
    config["model"]["decode_kernel"] = "triton"
    (run / "config.json").write_text(json.dumps(config))
    for ckpt in run.glob("checkpoints/hydra_*"):
        rewrite_state(ckpt, lambda state: state["model_config"].update(decode_kernel="triton"))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # Triton's kernels then run on CUDA only
    capsys.readouterr()
    assert main(["generate", "--run", str(run), "--prompt", "the", "--max_new_tokens", "4", "--device", "cpu"]) == 0
    note = "note: the run's decode_kernel='triton' cannot run on cpu: using 'auto'"
    assert note in capsys.readouterr().err
    assert main(["export", "--run", str(run), "--out", str(tmp_path / "model.safetensors")]) == 0
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as exported:  # exported as the run saved it
        assert json.loads(exported.metadata()["model_config"])["decode_kernel"] == "triton"
    monkeypatch.setitem(attention_backend._PACKAGES, "flash", ("flash-attn", False))
    flash = HydraConfig(vocab_size=128, dim=64, n_heads=2, n_kv_heads=1, attention_backend="flash")
    adapted, notes = kernels_for_device(flash, torch.device("cuda"))
    assert adapted == flash.replace(attention_backend="auto") and len(notes) == 1 and "'flash'" in notes[0]
    assert kernels_for_device(flash, torch.device("cpu")) == (flash, [])  # SDPA serves every backend there
