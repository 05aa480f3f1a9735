"""A checkpoint that does not fit the disk: one line naming the directory and the space, whatever form the writer's
error takes, and the earlier checkpoints kept."""

import errno
import os

import pytest

from safetensors import SafetensorError

from hydra_lm.train.checkpoint import verify
from hydra_lm.train.trainer import Trainer
from test_safety import checkpoints, train


# What a real full disk raises (a 2 MB tmpfs): an OSError, safetensors' error without an errno, torch.save's.
FULL_DISK_ERRORS = {"oserror": lambda name: OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), name),
                    "safetensors": lambda name: SafetensorError(
                        "Error while serializing: I/O error: No space left on device (os error 28)"),
                    "torch_save": lambda name: RuntimeError(
                        "[enforce fail at inline_container.cc:672] . unexpected pos 9152 vs 9044")}


@pytest.mark.parametrize("error", FULL_DISK_ERRORS)
def test_disk_full_while_saving_is_one_line_naming_the_path_and_space(tiny_data, tmp_path, monkeypatch, capsys,
                                                                      error):
    import hydra_lm.train.checkpoint as checkpoint
    import hydra_lm.train.resume as resume

    real_save, calls = checkpoint.save_model, []

    def save_model(model, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:  # the second checkpoint does not fit
            raise FULL_DISK_ERRORS[error](filename)
        return real_save(model, filename, metadata=metadata)

    monkeypatch.setattr(checkpoint, "save_model", save_model)
    monkeypatch.setattr(resume, "free_bytes", lambda directory: 1024)  # torch.save's error says nothing of space
    run = tmp_path / "run"
    assert train(tiny_data, run, "--max_steps", "6", "--keep_checkpoints", "2") == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"hydra-lm train: error: no space left on the device while writing a checkpoint to "
                          f"{run / 'checkpoints'} (")
    assert "MiB free, a checkpoint needs about" in err
    [kept] = checkpoints(run)
    assert kept.name.endswith("step3") and verify(kept).step == 3
    assert not list((run / "checkpoints").glob(".tmp-*"))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process through DCP, on purpose
@pytest.mark.parametrize("use_async", [False, True], ids=["dcp", "dcp_async"])
def test_disk_full_in_a_sharded_save_is_the_same_one_line(tiny_data, tmp_path, monkeypatch, capsys, use_async):
    """DCP hands a rank's failed write on inside a CheckpointException (a BaseException, not the OSError): still the
    one line, whether the save writes at once or in the background (then reported at its commit, where an
    asynchronous save also first logs "saved"). One process saves through the multi-process saver here."""
    from torch.distributed.checkpoint import FileSystemWriter

    from hydra_lm.train.sharded_checkpoint import ShardedSaver

    init, real_write, calls = Trainer.__init__, FileSystemWriter.write_data, []

    def with_sharded_saver(self, setup):
        init(self, setup)
        self.saver = ShardedSaver(setup.manager, self.dist, use_async, self.log.info)

    def write_data(self, plan, planner):
        calls.append(1)
        if len(calls) == 2:  # the second checkpoint does not fit
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(self, plan, planner)

    monkeypatch.setattr(Trainer, "__init__", with_sharded_saver)
    monkeypatch.setattr(FileSystemWriter, "write_data", write_data)
    run = tmp_path / "run"
    assert train(tiny_data, run, "--max_steps", "6", "--keep_checkpoints", "2") == 2
    out, err = capsys.readouterr()
    assert err.strip().splitlines()[-1].startswith(
        f"hydra-lm train: error: no space left on the device while writing a checkpoint to {run / 'checkpoints'} (")
    [kept] = checkpoints(run)
    assert kept.name.endswith("step3") and verify(kept).layout == "dcp"
    assert not list((run / "checkpoints").glob(".tmp-*")), "the failed save's partial files are gone"
    saved = f"saved checkpoint {kept}"
    if use_async:
        started = f"started saving checkpoint {kept} in the background"
        assert started in out and saved in out and out.index(started) < out.index(saved)
    else:
        assert saved in out and "in the background" not in out
    assert out.count("saved checkpoint") == 1
