"""Checkpoints: atomic layout, safe loading, rotation, corruption detection and fallback."""

import json
import re

import pytest
import torch

import hydra_lm
from hydra_lm.train.checkpoint import (FORMAT_VERSION, CheckpointError, CheckpointManager, capture_rng, restore_rng,
                                       resolve_checkpoint, verify)
from support import rewrite_state


def tiny():
    torch.manual_seed(0)
    return hydra_lm.create_model("debug", vocab_size=50, dim=32, n_heads=2, n_kv_heads=1, mlp_hidden=64,
                                 max_seq_len=16)


def save(manager, model, step):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, 50, (2, 8)), targets=torch.randint(0, 50, (2, 8)))["loss"].backward()
    opt.step()
    return manager.save(step, model, {"optimizer": opt.state_dict(), "torch": torch.get_rng_state()},
                        {"note": "test", "model_config": model.config.to_dict()})


def test_layout_latest_pointer_and_rotation(tmp_path):
    m = CheckpointManager(tmp_path / "ck", "debug", keep=2)
    model = tiny()
    for step in (1, 2, 3):
        path = save(m, model, step)
        assert path.name == f"hydra_debug_step{step}"
    assert [s for s, _ in m.list()] == [2, 3]  # kept the last 2
    assert (tmp_path / "ck" / "latest").read_text().strip() == "hydra_debug_step3"
    assert sorted(p.name for p in path.iterdir()) == ["model.safetensors", "state.json", "trainer.pt"]
    assert not list((tmp_path / "ck").glob(".tmp-*"))
    ck = verify(path)
    assert ck.step == 3 and ck.state["note"] == "test"
    trainer = ck.load_trainer()  # weights_only=True: no arbitrary unpickling
    assert "state" in trainer["optimizer"]
    fresh = tiny()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    ck.load_model(fresh)
    for a, b in zip(fresh.state_dict().values(), model.state_dict().values()):
        assert torch.equal(a, b)


def test_resaving_the_same_step_replaces_it_cleanly(tmp_path):
    m = CheckpointManager(tmp_path / "ck", "debug", keep=3)
    model = tiny()
    save(m, model, 5)
    save(m, model, 5)
    assert [s for s, _ in m.list()] == [5]
    verify(m.list()[0][1])


def test_a_crash_in_the_middle_of_a_resave_loses_no_checkpoint(tmp_path):
    # Saving a step again swaps the old directory aside, then moves the new one in: a crash between the two
    # renames leaves the complete checkpoint only under its set-aside name, which the next start puts back.
    m = CheckpointManager(tmp_path / "ck", "debug", keep=1)
    path = save(m, tiny(), 5)
    aside = path.with_name(f".old-{path.name}-4242")
    path.rename(aside)
    (tmp_path / "ck" / ".tmp-hydra_debug_step5-4242").mkdir()  # the new copy, half written
    (tmp_path / "ck" / ".latest.tmp-4242").write_text("hydra_debug_step5")  # and the latest pointer's, not renamed
    assert m.list() == [(5, aside)] and verify(aside).step == 5  # seen (a resume is decided on it), and usable
    m.cleanup_temp()
    assert [s for s, _ in m.list()] == [5] and verify(path).step == 5
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["hydra_debug_step5", "latest"]
    # Crashed after the swap instead: the set-aside copy is only a leftover.
    path.with_name(f".old-{path.name}-4243").mkdir()
    m.cleanup_temp()
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["hydra_debug_step5", "latest"]


def test_every_rename_is_on_disk_before_an_older_checkpoint_is_deleted(tmp_path, monkeypatch):
    """A rename is durable only once its directory is synced: otherwise a crash after the rotation deleted the oldest
    checkpoint could leave neither it nor the new one. Where a directory cannot be opened (Windows) saves go on."""
    import os
    import shutil
    import stat

    events = []
    replace, fsync, rmtree = os.replace, os.fsync, shutil.rmtree

    def renamed(src, dst):
        replace(src, dst)
        events.append(("rename", os.stat(os.path.dirname(dst)).st_ino))

    def synced(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            events.append(("sync", os.fstat(fd).st_ino))
        fsync(fd)
    monkeypatch.setattr(os, "replace", renamed)
    monkeypatch.setattr(os, "fsync", synced)
    monkeypatch.setattr(shutil, "rmtree", lambda path, **kw: (events.append(("delete", None)), rmtree(path, **kw)))
    m = CheckpointManager(tmp_path / "ck", "debug", keep=1)
    model = tiny()
    for step in (1, 2, 2):  # a rotation, then the same step saved again (set aside, then deleted)
        save(m, model, step)
    assert sum(kind == "delete" for kind, _ in events) == 2
    for i, (kind, directory) in enumerate(events):
        if kind == "rename":
            after = [e for e in events[i + 1:] if e[0] == "delete" or e == ("sync", directory)]
            assert after and after[0] == ("sync", directory), events

    def no_directories(path, flags, *args):
        raise PermissionError(13, "Permission denied", path)
    monkeypatch.setattr(os, "open", no_directories)
    assert verify(save(m, model, 3)).step == 3


@pytest.mark.parametrize("damage", ["truncate_model", "flip_trainer", "drop_state", "garble_state",
                                    "retype_state", "edit_state"])
def test_damage_is_detected_naming_the_file_and_resume_falls_back(tmp_path, damage):
    warnings = []
    m = CheckpointManager(tmp_path / "ck", "debug", keep=5, warn=warnings.append)
    model = tiny()
    save(m, model, 1)
    bad = save(m, model, 2)
    if damage == "truncate_model":
        f = bad / "model.safetensors"
        f.write_bytes(f.read_bytes()[:100])
    elif damage == "flip_trainer":
        f = bad / "trainer.pt"
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
    elif damage == "drop_state":
        f = bad / "state.json"
        f.unlink()
    elif damage == "retype_state":  # valid JSON of the wrong shape, hashed
        f = bad / "state.json"
        rewrite_state(bad, lambda state: state["files"].update({"model.safetensors": {"size": 1}}))
    elif damage == "edit_state":  # a value changed (it passed verify before state.json hashed its own content)
        f = bad / "state.json"
        f.write_text(f.read_text().replace('"note": "test"', '"note": "edited"'))
    else:
        f = bad / "state.json"
        f.write_text(f.read_text()[:40])
    with pytest.raises(CheckpointError, match=str(f)):
        verify(bad)
    good = m.latest_good()
    assert good.step == 1
    assert warnings and str(f) in warnings[0] and "falling back" in warnings[0]
    assert (tmp_path / "ck" / "hydra_debug_step2.corrupt").is_dir()  # kept for inspection, not deleted
    assert (tmp_path / "ck" / "latest").read_text().strip() == "hydra_debug_step1"


def test_a_file_where_the_checkpoints_go_is_refused_before_training(tmp_path):
    (tmp_path / "ck").write_text("not a directory")
    with pytest.raises(ValueError, match=r"ck is not a directory, so checkpoints cannot be saved there"):
        CheckpointManager(tmp_path / "ck", "debug")


def test_a_stray_file_beside_a_checkpoints_files_does_not_set_it_aside(tmp_path):
    """Only the files state.json lists are read, so a file manager's .DS_Store or a user's notes in a checkpoint must
    not cost the run its newest checkpoint (a shard slipped into the sharded layout is still refused:
    test_safe_loading.py)."""
    m = CheckpointManager(tmp_path / "ck", "debug", keep=5)
    model = tiny()
    save(m, model, 1)
    path = save(m, model, 2)
    (path / ".DS_Store").write_bytes(b"x")
    (path / "notes").mkdir()
    (path / "notes" / "why.txt").write_text("a good step")
    assert m.latest_good().step == 2 and m.quarantined() == []


def test_a_run_directory_or_a_checkpoints_lost_state_is_named_for_what_it_is(tmp_path):
    run = tmp_path / "run"
    m = CheckpointManager(run / "checkpoints", "debug", keep=5)
    path = save(m, tiny(), 1)
    for wrong in (run, run / "checkpoints"):
        with pytest.raises(CheckpointError, match="its checkpoints directory, not a checkpoint"):
            verify(wrong)
    (path / "state.json").unlink()
    for given in (path, path / "model.safetensors"):  # not taken for an exported model
        with pytest.raises(CheckpointError, match="state.json is missing"):
            verify(given)


def test_a_step_corrupt_again_is_set_aside_beside_the_first(tmp_path):
    """A checkpoint of a step that was set aside before (the run went back past it and saved it again) gets a name
    of its own: left in place, it stayed among the checkpoints, warned about at every resume."""
    m = CheckpointManager(tmp_path / "ck", "debug", keep=5)
    model = tiny()
    save(m, model, 1)
    for _ in range(2):
        path = save(m, model, 2)
        (path / "model.safetensors").write_bytes(b"damaged")
        assert m.latest_good().step == 1
        assert [step for step, _ in m.list()] == [1]
    assert [p.name for p in m.quarantined()] == ["hydra_debug_step2.corrupt", "hydra_debug_step2.corrupt2"]


def test_an_unhashed_state_must_match_its_name_and_a_newer_format_is_refused_not_set_aside(tmp_path):
    """Checkpoints from before state.json hashed its own content load unchecked, but their step must be their
    name's; a checkpoint of a newer format than this code reads is refused with what to do, and left in place."""
    m = CheckpointManager(tmp_path / "ck", "debug", keep=5)
    path = save(m, tiny(), 2)
    f = path / "state.json"
    f.write_text(f.read_text().replace('"step": 2,', '"step": 3,'))
    with pytest.raises(CheckpointError, match="corrupt: its content does not match its SHA-256"):
        verify(path)
    rewrite_state(path, lambda state: None, hashed=False)
    with pytest.raises(CheckpointError, match="corrupt: it records step 3, its directory's name step 2"):
        verify(path)
    rewrite_state(path, lambda state: state.update(step=2), hashed=False)
    assert verify(path).step == 2
    rewrite_state(path, lambda state: state.update(format=FORMAT_VERSION + 1))
    with pytest.raises(ValueError, match=f"has format {FORMAT_VERSION + 1}, newer than hydra-lm .* reads .*upgrade"):
        m.latest_good()
    assert [p.name for p in (tmp_path / "ck").iterdir() if p.is_dir()] == [path.name]  # not set aside as corrupt


def test_every_checkpoint_broken_is_an_error_not_a_fresh_start(tmp_path):
    m = CheckpointManager(tmp_path / "checkpoints", "debug", keep=5)
    path = save(m, tiny(), 1)
    (path / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="no readable checkpoint"):
        resolve_checkpoint(tmp_path)  # reads only: the broken checkpoint stays where it is
    with pytest.raises(CheckpointError, match="no readable checkpoint"):
        m.latest_good()  # sets it aside as *.corrupt


def test_resolve_checkpoint_accepts_a_directory_a_file_or_a_name(tmp_path, monkeypatch):
    m = CheckpointManager(tmp_path / "checkpoints", "debug")
    path = save(m, tiny(), 7)
    assert resolve_checkpoint(tmp_path).step == 7
    assert resolve_checkpoint(tmp_path, path / "model.safetensors").step == 7
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_checkpoint(tmp_path, tmp_path / "nope")
    monkeypatch.chdir(tmp_path / "checkpoints")  # a name finds the checkpoint here or in the run's checkpoints/
    assert resolve_checkpoint(tmp_path / "run", path.name).step == 7
    monkeypatch.chdir(tmp_path)
    assert resolve_checkpoint(tmp_path, path.name).step == 7
    with pytest.raises(CheckpointError, match=re.escape(f"nope does not exist, here or in {tmp_path / 'checkpoints'}")):
        resolve_checkpoint(tmp_path, "nope")
    stray = tmp_path / "model.pt"
    stray.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="neither a checkpoint directory's file nor an exported"):
        resolve_checkpoint(tmp_path, stray)
    with pytest.raises(CheckpointError, match="has no checkpoint"):
        resolve_checkpoint(tmp_path / "empty")


def test_rng_state_round_trips_through_json_and_tensors():
    import random

    import numpy as np

    json_part, tensors = capture_rng()
    json_part = json.loads(json.dumps(json_part))
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    restore_rng(json_part, tensors)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected
