"""One clear line (exit 2) where a command's input is wrong: paths that are files where directories go (and the
other way), a data directory and a run directory in one place, a run whose data or tokenizer moved, values out of
range; each checked before the slow part of the command."""

import errno
import json
import os
import shutil

import pytest
import torch

from hydra_lm.cli import main
from support import TINY_RUN, prepare, rewrite_state, write_corpus


def err_of(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    return err[-1] if err else ""


@pytest.fixture(scope="module")
def run(tiny_data, tmp_path_factory):
    """A run of two steps, to load; tests that change it change a copy."""
    run = tmp_path_factory.mktemp("errors") / "run"
    assert main(["train", "--data", str(tiny_data), "--out", str(run), *TINY_RUN, "--max_steps", "2"]) == 0
    return run


@pytest.fixture(scope="module")
def other_tokenizer(tmp_path_factory):
    """A prepared directory of another corpus, so another tokenizer."""
    root = tmp_path_factory.mktemp("other")
    return prepare(write_corpus(root / "corpus", n_docs=10, words=100, seed=1), root / "data", vocab_size=280)


def test_prepare_refuses_an_out_that_holds_a_training_run(run, tmp_path, capsys):
    copy = shutil.copytree(run, tmp_path / "run")
    before = (copy / "tokenizer.json").read_bytes()
    assert main(["prepare", "--inputs", str(write_corpus(tmp_path / "corpus", n_docs=4)), "--out", str(copy),
                 "--vocab_size", "280", "--no_progress"]) == 2
    assert err_of(capsys) == (f"hydra-lm prepare: error: {copy} holds a training run (config.json, checkpoints/): "
                              "preparing data there would replace the run's tokenizer.json; choose another --out")
    assert (copy / "tokenizer.json").read_bytes() == before and not (copy / "meta.json").exists()


@pytest.mark.parametrize("inside", ["", "runs/r1"])
def test_train_and_compare_refuse_an_out_that_is_or_lies_inside_their_data(tiny_data, tmp_path, capsys, inside):
    data = shutil.copytree(tiny_data, tmp_path / "data")
    out = data / inside if inside else data
    assert main(["train", "--data", str(data), "--out", str(out), *TINY_RUN, "--max_steps", "1"]) == 2
    where = "is inside" if inside else "is"
    assert err_of(capsys) == (f"hydra-lm train: error: --out {out} {where} the data directory {data}: a later "
                              "`hydra-lm prepare` there would replace the run's tokenizer.json; choose an --out "
                              "outside it")
    assert main(["compare", "--data", str(data), "--out", str(out), "--budget", "tokens=256", "--variants", "dense",
                 *TINY_RUN]) == 2  # up front, not as each variant's run starts
    assert f"--out {out} {where} the data directory {data}:" in err_of(capsys)
    assert main(["train", "--dataset", str(data), "--out", str(out), *TINY_RUN, "--max_steps", "1"]) == 2
    assert f"--out {out} {where} the data directory {data}:" in err_of(capsys)
    assert sorted(p.name for p in data.iterdir()) == sorted(p.name for p in tiny_data.iterdir())  # nothing written


def test_generate_decodes_with_the_tokenizer_the_run_recorded(run, other_tokenizer, tmp_path, capsys):
    greedy = ["--prompt", "the quick", "--max_new_tokens", "6", "--temperature", "0", "--device", "cpu"]
    assert main(["generate", "--run", str(run), *greedy]) == 0
    expected = capsys.readouterr().out
    copy = shutil.copytree(run, tmp_path / "run")
    shutil.copyfile(other_tokenizer / "tokenizer.json", copy / "tokenizer.json")  # a replaced copy
    assert main(["generate", "--run", str(copy), *greedy]) == 0  # the data directory's is the run's
    assert capsys.readouterr().out == expected
    # its data directory prepared again, with another tokenizer (the run and its checkpoints name that directory)
    config = json.loads((copy / "config.json").read_text())
    config["data"]["path"] = str(other_tokenizer)
    (copy / "config.json").write_text(json.dumps(config))
    for checkpoint in (copy / "checkpoints").glob("hydra_*"):
        rewrite_state(checkpoint, lambda state: state["data"].__setitem__("path", str(other_tokenizer)))
    assert main(["generate", "--run", str(copy), *greedy]) == 2
    assert err_of(capsys) == (f"hydra-lm generate: error: run {copy} was not trained with the tokenizer in "
                              f"{copy / 'tokenizer.json'} or {other_tokenizer} (its fingerprint differs from the one "
                              "its checkpoint records): put back the tokenizer.json of the data directory it "
                              "trained on")


def test_a_run_whose_data_directory_is_gone_says_so(tiny_data, tmp_path, capsys):
    data = shutil.copytree(tiny_data, tmp_path / "data")
    run = tmp_path / "run"
    assert main(["train", "--data", str(data), "--out", str(run), *TINY_RUN, "--max_steps", "1"]) == 0
    shutil.rmtree(data)
    capsys.readouterr()
    assert main(["eval", "--run", str(run), "--device", "cpu"]) == 2
    assert err_of(capsys) == (f"hydra-lm eval: error: run {run} was trained on {data}, which is gone; pass --data DIR "
                              "prepared with the run's tokenizer")
    assert main(["train", "--out", str(run), "--max_steps", "2"]) == 2
    assert err_of(capsys) == (f"hydra-lm train: error: run {run} was trained on {data}, which is gone; pass --data "
                              "DIR prepared with the run's tokenizer to resume")
    (run / "tokenizer.json").unlink()
    assert main(["generate", "--run", str(run), "--prompt", "a", "--device", "cpu"]) == 2
    assert err_of(capsys) == (f"hydra-lm generate: error: run {run} has no tokenizer: its tokenizer.json is missing "
                              f"and its data directory {data} is gone; put back the tokenizer.json of the data "
                              "directory it trained on")


def test_a_run_trained_on_a_relative_data_path_resumes_from_another_directory(tiny_data, tmp_path, monkeypatch):
    shutil.copytree(tiny_data, tmp_path / "data")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--data", "data", "--out", "run", *TINY_RUN, "--max_steps", "1"]) == 0
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert main(["train", "--out", str(tmp_path / "run"), *TINY_RUN, "--max_steps", "2"]) == 0
    assert json.loads((tmp_path / "run" / "config.json").read_text())["train"]["data"] == str(tmp_path / "data")


def test_a_step_larger_than_the_training_split_is_warned_about(tiny_data, tmp_path):
    from hydra_lm.data import read_meta

    split = read_meta(tiny_data)["token_counts"]["train"]
    assert main(["train", "--data", str(tiny_data), "--out", str(tmp_path / "big"), *TINY_RUN, "--max_steps", "1",
                 "--grad_accum", str(split // (4 * 32) + 1)]) == 0
    log = (tmp_path / "big" / "train.log").read_text()
    assert f"the training split's {split:,}: each step repeats data; lower --batch_size or --grad_accum" in log
    assert main(["train", "--data", str(tiny_data), "--out", str(tmp_path / "small"), *TINY_RUN, "--max_steps",
                 "1"]) == 0
    assert "repeats data" not in (tmp_path / "small" / "train.log").read_text()


def test_paths_that_cannot_be_made_are_one_line(run, tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("a file")
    for argv, line in (
            (["export", "--run", str(run), "--out", str(afile / "x.safetensors")],
             f"export: error: cannot create the directory: {afile}: File exists; a file of that name is in the way"),
            (["prepare", "--inputs", str(write_corpus(tmp_path / "corpus", n_docs=4)), "--out", str(afile / "x")],
             f"prepare: error: cannot create or open: {afile / 'x'}: Not a directory; a part of that path is a file"),
            (["quickstart", "--out", str(afile)],
             f"quickstart: error: cannot create or open: {afile / 'data'}: Not a directory; a part of that path")):
        assert main(argv) == 2
        assert err_of(capsys).startswith(f"hydra-lm {line}")
    (tmp_path / "d.safetensors").mkdir()
    assert main(["export", "--run", str(run), "--out", str(tmp_path / "d.safetensors")]) == 2
    assert err_of(capsys) == (f"hydra-lm export: error: --out {tmp_path / 'd.safetensors'} is a directory: name a "
                              f"file, e.g. --out {tmp_path / 'd.safetensors' / 'model.safetensors'}")
    assert list(tmp_path.glob(".*")) == []  # no temporary file left behind


def test_a_failed_export_write_is_one_line_and_leaves_no_temporary_file(run, tmp_path, monkeypatch, capsys):
    from safetensors import SafetensorError

    import hydra_lm.train.checkpoint as checkpoint

    def save_model(model, path, metadata):
        open(path, "wb").close()
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(checkpoint, "save_model", save_model)
    out = tmp_path / "m.safetensors"
    assert main(["export", "--run", str(run), "--out", str(out)]) == 2
    assert err_of(capsys).startswith(f"hydra-lm export: error: cannot write {out}: Error while serializing")
    assert list(tmp_path.iterdir()) == []


def test_exported_and_checkpointed_weights_are_readable_as_the_umask_allows(run, tmp_path):
    """safetensors creates its files 0600 whatever the umask: an exported model on a shared filesystem was
    readable by its writer alone."""
    old = os.umask(0o022)
    try:
        out = tmp_path / "m.safetensors"
        assert main(["export", "--run", str(run), "--out", str(out)]) == 0
    finally:
        os.umask(old)
    assert out.stat().st_mode & 0o777 == 0o644
    written = list((run / "checkpoints").glob("*/model.safetensors"))  # under the test runner's umask
    assert written and all(w.stat().st_mode & 0o044 == 0o044 & ~old for w in written)


def test_an_os_error_without_a_path_keeps_its_traceback(monkeypatch):
    import hydra_lm.cli as cli

    def fail(args):
        raise ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")

    monkeypatch.setattr(cli, "_cmd_info", fail)
    with pytest.raises(ConnectionResetError):
        main(["info"])


def test_model_values_take_the_numbers_flags_take(tiny_data, tmp_path, capsys):
    from hydra_lm.diagnostics.variants import parse_custom_variant
    from hydra_lm.train.flags import split_model_overrides

    _, values = split_model_overrides(["--model.mod_capacity", ".5", "--model.mor_capacity=+0.25",
                                       "--model.n_blocks", "+3", "--model.mor_routing", "token"])
    assert values == {"mod_capacity": 0.5, "mor_capacity": 0.25, "n_blocks": 3, "mor_routing": "token"}
    assert type(values["n_blocks"]) is int
    assert parse_custom_variant("cap:mod_capacity=.5").overrides == {"mod_capacity": 0.5}
    assert main(["train", "--data", str(tiny_data), "--out", str(tmp_path / "r"), *TINY_RUN, "--max_steps", "1",
                 "--model.mod_capacity", "nan"]) == 2
    assert "mod_capacity=nan: must lie in (0, 1]" in err_of(capsys)  # the range, not "must be a number"


def test_quickstart_checks_device_and_seed_before_preparing_the_corpus(tmp_path, monkeypatch):
    import hydra_lm.data
    from hydra_lm import quickstart as module

    def prepare(inputs, out):
        raise AssertionError("the corpus was prepared before the arguments were checked")

    monkeypatch.setattr(hydra_lm.data, "prepare_data", prepare)
    with pytest.raises(ValueError, match="--device tpu: not a device"):
        module.quickstart(tmp_path / "qs", device="tpu")
    with pytest.raises(ValueError, match=r"--seed -1 must lie in \[0, 2\*\*32 - 1"):
        module.quickstart(tmp_path / "qs", seed=-1, device="cpu")


@pytest.mark.parametrize("seed", ["-1", str(2**32)])
def test_seeds_numpy_cannot_take_are_refused_naming_the_flag(tiny_data, tmp_path, capsys, seed):
    assert main(["train", "--data", str(tiny_data), "--out", str(tmp_path / "r"), *TINY_RUN, "--max_steps", "1",
                 "--seed", seed]) == 2
    assert err_of(capsys) == f"hydra-lm train: error: --seed {seed} must lie in [0, 2**32 - 1 = {2**32 - 1}]"
    assert not (tmp_path / "r").exists()  # a refused start leaves no run directory behind
    assert main(["compare", "--data", str(tiny_data), "--out", str(tmp_path / "c"), "--budget", "tokens=256",
                 "--variants", "dense", *TINY_RUN, "--seeds", "0", str(2**32)]) == 2
    assert f"--seeds {2**32} must lie in [0, 2**32 - 1" in err_of(capsys)
    assert main(["scaling", "--results", str(tmp_path), "--seed", "-1"]) == 2
    assert err_of(capsys) == "hydra-lm scaling: error: --seed -1: must be >= 0"


def test_generate_top_k_takes_zero_for_all_and_refuses_a_negative(run, capsys):
    assert main(["generate", "--run", str(run), "--prompt", "a", "--top_k", "-1"]) == 2
    assert err_of(capsys) == "hydra-lm generate: error: --top_k -1 must be 0 (all tokens) or more"


def test_generate_checks_its_sampling_before_loading_the_checkpoint(run, capsys, monkeypatch):
    import hydra_lm.infer.runs as runs

    monkeypatch.setattr(runs, "load_run", lambda *a, **k: pytest.fail("loaded the checkpoint first"))
    for flag, value in (("--temperature", "-1"), ("--top_p", "0")):
        assert main(["generate", "--run", str(run), "--prompt", "a", flag, value]) == 2
        assert "must" in err_of(capsys)


def test_info_memory_checks_its_batch_before_printing_anything(capsys):
    assert main(["info", "--model_size", "debug", "--memory", "--batch_size", "0"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "--batch_size 0" in captured.err


def test_cpu_runs_that_cannot_fit_the_hosts_memory_are_refused_before_anything_is_built(tiny_data, tmp_path,
                                                                                        monkeypatch, capsys):
    """Linux's out-of-memory killer ends such a run without a word: the estimate refuses it up front instead."""
    from hydra_lm.diagnostics import bench
    from hydra_lm.train import memory_estimate

    monkeypatch.setattr(memory_estimate, "available_host_mb", lambda: 1.0)
    out = tmp_path / "run"
    assert main(["train", "--data", str(tiny_data), "--out", str(out), *TINY_RUN, "--max_steps", "1"]) == 2
    err = err_of(capsys)
    assert err.startswith("hydra-lm train: error: training debug on batches of ") and "1 MB available" in err
    assert "lower --batch_size (--grad_accum keeps the tokens per step)" in err and not out.exists()

    def never(*args, **kwargs):
        raise AssertionError("the model was built before the memory check")

    monkeypatch.setattr(bench, "create_model", never)
    assert main(["bench", "--device", "cpu", "--model_size", "debug", "--arch", "dense", "--seq_len", "64"]) == 2
    assert err_of(capsys).startswith("hydra-lm bench: error: bench of debug (dense) on batches of 16 x 64: its "
                                     "estimated training peak is ")

    monkeypatch.setattr(memory_estimate, "available_host_mb", lambda: 1000.0)
    memory_estimate.check_fits_host(400.0, "run", "advice", processes=2)  # 800 of 1,000 MB: fits
    with pytest.raises(ValueError, match=r"1,200 MB \(2 processes of 600 MB\), but this machine has 1,000 MB"):
        memory_estimate.check_fits_host(600.0, "run", "advice", processes=2)


OOM = ("CUDA out of memory. Tried to allocate 24.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.50 GiB is "
       "free. Including non-PyTorch memory, this process has 77.68 GiB memory in use. Of the allocated memory 70.1 GiB "
       "is allocated by PyTorch")


def test_running_out_of_gpu_memory_is_one_line_that_says_what_to_change_and_the_run_resumes(tiny_data, tmp_path,
                                                                                             monkeypatch, capsys):
    from hydra_lm.train.step import TrainStep

    micro, calls = TrainStep.micro, []

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # the third step, after the second step's checkpoint
            raise torch.OutOfMemoryError(OOM)
        return micro(self, *args, **kwargs)

    monkeypatch.setattr(TrainStep, "micro", failing)
    out = tmp_path / "run"
    command = ["train", "--data", str(tiny_data), "--out", str(out), *TINY_RUN, "--grad_accum", "1", "--max_steps", "4",
               "--save_every", "2", "--eval_every", "0", "--no-eval_at_start"]
    assert main(command) == 1
    assert err_of(capsys) == (
        "hydra-lm train: error: out of GPU memory: CUDA out of memory. Tried to allocate 24.00 GiB. GPU 0 has a total "
        "capacity of 79.19 GiB of which 1.50 GiB is free; lower --batch_size (--grad_accum keeps the tokens per step) "
        "or --seq_len, turn on --gradient_checkpointing, or use a smaller --model_size (`hydra-lm info --memory` "
        "estimates the peak); checkpoints already written are kept, and the same command resumes from the last")
    monkeypatch.setattr(TrainStep, "micro", micro)
    assert main(command) == 0
    assert f"resumed from {out / 'checkpoints' / 'hydra_debug_step2'} at step 2" in (out / "train.log").read_text()
    assert (out / "checkpoints" / "hydra_debug_step4").is_dir()


def test_train_and_compare_refuse_each_others_output_directories(run, tiny_data, tmp_path, capsys):
    assert main(["compare", "--data", str(tiny_data), "--out", str(run), "--budget", "tokens=256", "--variants",
                 "dense", *TINY_RUN]) == 2
    assert "holds a training run (config.json, checkpoints/)" in err_of(capsys)
    compared = tmp_path / "compared"
    (compared / "runs").mkdir(parents=True)
    (compared / "results.json").write_text("{}")
    assert main(["train", "--data", str(tiny_data), "--out", str(compared), *TINY_RUN, "--max_steps", "1"]) == 2
    assert "holds a `hydra-lm compare` output" in err_of(capsys)
