"""No loader runs code from a file: each gets a crafted pickle whose unpickling would create a marker file.

The payload's ``__reduce__`` calls ``os.system("touch MARKER")``; every test asserts that the
loader refuses with a clear error and that the marker does not exist.
"""

import os
import pickle
import warnings

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

import hydra_lm
from hydra_lm.cli import main
from hydra_lm.data import load_tokenizer
from hydra_lm.data.readers import load_token_docs
from hydra_lm.data.shards import open_split
from hydra_lm.train.checkpoint import DCP_DIR, CheckpointError, CheckpointManager, verify
from hydra_lm.train.sharded_checkpoint import load_dcp
from support import prepare, rewrite_state, write_corpus


class Payload:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture
def marker(tmp_path):
    path = tmp_path / "PWNED"
    yield path
    assert not path.exists(), "the crafted payload ran"


def tiny():
    torch.manual_seed(0)
    return hydra_lm.create_model("debug", vocab_size=50, dim=32, n_heads=2, n_kv_heads=1, mlp_hidden=64,
                                 max_seq_len=16)


def stepped(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, 50, (2, 8)), targets=torch.randint(0, 50, (2, 8)))["loss"].backward()
    opt.step()
    return opt


def dcp_checkpoint(tmp_path, model, opt, tamper):
    """A sharded checkpoint whose state.json lists (and hashes) the tampered files, as an attacker's would."""
    manager = CheckpointManager(tmp_path / "ck", "debug")
    tmp = manager.begin(1, "crafted")
    model_sd, optim_sd = get_state_dict(model, opt)
    tamper(tmp / DCP_DIR, model_sd, optim_sd)
    return manager.commit(tmp, 1, {"layout": "dcp", "world_size": 1, "model_config": model.config.to_dict()})


def save_dcp(directory, model_sd, optim_sd):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(directory), no_dist=True)


def test_sharded_metadata_pickle_is_refused_everywhere(tmp_path, marker, capsys):
    model = tiny()

    def tamper(directory, model_sd, optim_sd):
        save_dcp(directory, model_sd, optim_sd)
        (directory / ".metadata").write_bytes(pickle.dumps(Payload(marker)))

    path = dcp_checkpoint(tmp_path, model, stepped(model), tamper)
    with pytest.raises(CheckpointError, match=r"\.metadata is not safe to load.*posix\.system|\.metadata is not "
                                              r"safe to load.*os\.system"):
        load_dcp(verify(path), tiny())  # the path eval, generate and export take for sharded checkpoints
    # eval, generate and export all load through the same path: one line, exit 2.
    assert main(["export", "--run", str(tmp_path), "--checkpoint", str(path), "--out",
                 str(tmp_path / "x.safetensors")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "not safe to load" in err and "Traceback" not in err


def test_sharded_byte_entry_pickle_is_refused_on_resume(tmp_path, marker):
    model = tiny()
    opt = stepped(model)

    def tamper(directory, model_sd, optim_sd):
        optim_sd["param_groups"][0]["lr"] = Payload(marker)  # a non-tensor entry: stored as a pickle
        save_dcp(directory, model_sd, optim_sd)

    path = dcp_checkpoint(tmp_path, model, opt, tamper)
    target = tiny()
    with pytest.raises(CheckpointError, match=r"cannot be loaded into this model: .*GLOBAL posix\.system"):
        load_dcp(verify(path), target, stepped(target))


def test_an_untouched_sharded_checkpoint_still_loads(tmp_path):
    model = tiny()
    path = dcp_checkpoint(tmp_path, model, stepped(model), save_dcp)
    fresh = tiny()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    load_dcp(verify(path), fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-3))
    for a, b in zip(fresh.state_dict().values(), model.state_dict().values()):
        assert torch.equal(a, b)


def test_files_missing_from_the_checksum_list_are_refused(tmp_path):
    model = tiny()
    path = dcp_checkpoint(tmp_path, model, stepped(model), save_dcp)
    (path / DCP_DIR / "__1_0.distcp").write_bytes(b"extra")
    with pytest.raises(CheckpointError, match=r"does not list.*__1_0\.distcp"):
        verify(path)
    (path / DCP_DIR / "__1_0.distcp").unlink()
    rewrite_state(path, lambda state: state["files"].pop(f"{DCP_DIR}/.metadata"))  # hashed, as an attacker's would be
    with pytest.raises(CheckpointError, match="does not list"):
        verify(path)


def test_model_and_trainer_files_are_never_unpickled(tmp_path, marker):
    manager = CheckpointManager(tmp_path / "ck", "debug")
    tmp = manager.begin(1, "crafted")
    (tmp / "model.safetensors").write_bytes(pickle.dumps(Payload(marker)))
    torch.save({"optimizer": Payload(marker)}, tmp / "trainer.pt")
    ckpt = verify(manager.commit(tmp, 1, {"model_config": tiny().config.to_dict()}))
    with pytest.raises(CheckpointError, match="model.safetensors cannot be read"):
        ckpt.load_model(tiny())
    with pytest.raises(CheckpointError, match="trainer.pt cannot be read"):
        ckpt.load_trainer()


def test_data_files_and_tokenizer_are_never_unpickled(tmp_path, marker):
    data = prepare(write_corpus(tmp_path / "corpus", n_docs=6, words=50), tmp_path / "data")
    payload = pickle.dumps(Payload(marker))
    np.save(data / "train.idx.npy", np.array([Payload(marker)], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match="not a plain integer array"):
        open_split(data, "train")
    (data / "tokenizer.json").write_bytes(payload)
    with pytest.raises(ValueError, match="could not load tokenizer file"):
        load_tokenizer(data)
    torch.save({"input_ids": Payload(marker)}, tmp_path / "shard.pt")
    with pytest.raises(ValueError, match="could not load"):
        load_token_docs(tmp_path / "shard.pt", "pt")
    np.save(tmp_path / "shard.npy", np.array([Payload(marker)], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match="could not load"):
        load_token_docs(tmp_path / "shard.npy", "npy")
    (data / "meta.json").write_bytes(payload)
    with pytest.raises(ValueError, match="not valid JSON"):
        open_split(data, "train")
