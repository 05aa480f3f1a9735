"""The identity of prepared data: a corpus touched and prepared again is the same data to a resumed loader, a
resumed run and its evaluation; a corpus whose content changed is not."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from support import TINY_RUN, main, prepare, records, write_corpus

from hydra_lm.data import PackedLoader, prepare_data, read_meta

LOADER = dict(batch_size=2, seq_len=16)


def _touch(directory) -> None:
    later = time.time_ns() + 5 * 10**9
    for path in directory.rglob("*.txt"):
        os.utime(path, ns=(later, later))


def _same(a, b) -> bool:
    return all(torch.equal(a[k], b[k]) for k in ("input_ids", "targets", "doc_ids"))


@pytest.fixture()
def prepared(tmp_path):
    """A corpus, its preparation, and a loader state saved 3 batches in with the 4 batches that follow it."""
    corpus = write_corpus(tmp_path / "corpus", n_docs=12, words=120)
    out = prepare_data([str(corpus)], tmp_path / "out", vocab_size=300, val_fraction=0.2, progress=False)
    loader = PackedLoader(out, "train", seed=4, **LOADER)
    for _ in range(3):
        next(loader)
    state = json.loads(json.dumps(loader.state_dict()))
    return corpus, out, state, [next(loader) for _ in range(4)]


def _prepare_again(corpus, out) -> None:
    before = read_meta(out)["fingerprint"]
    prepare_data([str(corpus)], out, vocab_size=300, val_fraction=0.2, progress=False)
    assert read_meta(out)["fingerprint"] != before, "the inputs' mtimes are part of prepare's own fingerprint"


def test_a_loader_resumes_on_its_corpus_touched_and_prepared_again(prepared):
    corpus, out, state, expected = prepared
    _touch(corpus)
    _prepare_again(corpus, out)
    resumed = PackedLoader(out, "train", seed=0, **LOADER)
    resumed.load_state_dict(state)
    assert all(_same(x, y) for x, y in zip(expected, (next(resumed) for _ in range(4))))


def test_a_loader_refuses_its_corpus_changed_and_prepared_again(prepared):
    corpus, out, state, _ = prepared
    (corpus / "doc0.txt").write_text("a document that was not there when the run started\n")
    _prepare_again(corpus, out)
    with pytest.raises(ValueError, match="data there changed since the run started .prepared again from a changed "
                                         "corpus.*Resume with the data the run started with"):
        PackedLoader(out, "train", **LOADER).load_state_dict(state)


def test_states_and_directories_without_a_content_identity_compare_fingerprints(prepared):
    _, out, state, expected = prepared
    loader = PackedLoader(out, "train", **LOADER)
    old_state = {k: v for k, v in state.items() if k != "data_content"}
    loader.load_state_dict(old_state)
    assert _same(next(loader), expected[0])
    with pytest.raises(ValueError, match="other data"):
        loader.load_state_dict({**old_state, "data_fingerprint": "another preparation"})
    meta = json.loads((out / "meta.json").read_text())
    del meta["content_sha256"]
    (out / "meta.json").write_text(json.dumps(meta))
    old_dir = PackedLoader(out, "train", **LOADER)
    old_dir.load_state_dict(state)
    assert _same(next(old_dir), expected[0])
    with pytest.raises(ValueError, match="other data"):
        old_dir.load_state_dict({**state, "data_fingerprint": "another preparation"})


def test_a_run_resumes_and_evaluates_after_its_corpus_is_touched_and_prepared_again(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", n_docs=20)
    data = prepare(corpus, tmp_path / "data")
    run = tmp_path / "run"
    args = ["train", "--data", str(data), "--out", str(run), *TINY_RUN, "--max_steps", "4", "--log_every", "1",
            "--eval_every", "0", "--no-eval_at_start", "--eval_batches", "1"]
    assert main([*args, "--stop_at_step", "2"]) == 0
    fingerprint = read_meta(data)["fingerprint"]
    _touch(corpus)
    prepare(corpus, data)
    assert read_meta(data)["fingerprint"] != fingerprint
    assert main(["eval", "--run", str(run), "--eval_batches", "1"]) == 0  # its checkpoint predates the rebuild
    assert main(args) == 0
    assert [r["step"] for r in records(run, "train")] == [1, 2, 3, 4], "resumed at step 3, not started again"


def test_prepared_again_with_its_own_tokenizer_file_the_data_is_the_same(prepared, tmp_path):
    """The tokenizer a preparation trained, given back with --tokenizer: the same tokens, so the same content (its
    fingerprint was the trained object's kind, "bpe", against the loaded file's "tokenizers")."""
    corpus, out, state, expected = prepared
    again = prepare_data([str(corpus)], tmp_path / "again", tokenizer=str(out / "tokenizer.json"), val_fraction=0.2,
                         progress=False)
    assert (again / "train.bin").read_bytes() == (out / "train.bin").read_bytes()
    assert read_meta(again)["content_sha256"] == read_meta(out)["content_sha256"]
    resumed = PackedLoader(again, "train", **LOADER)
    resumed.load_state_dict(state)
    assert _same(next(resumed), expected[0])


def test_tokenizer_training_cuts_only_long_runs_of_one_character_class():
    from hydra_lm.data.tokenizer import _RUN_CHARS, _long_runs_cut

    ordinary = "def f(x):\n    return x  # a comment\n" * 500
    assert list(_long_runs_cut([ordinary])) == [ordinary]  # ordinary text trains the tokenizer it always did
    texts = ["head " + "ACGT" * 2500 + " tail", " " * 9000, "x" * 4096]
    pieces = list(_long_runs_cut(texts))
    assert "".join(pieces) == "".join(texts) and max(map(len, pieces)) == _RUN_CHARS and len(pieces) == 9


def test_token_files_take_the_narrowest_type_that_holds_every_id():
    from hydra_lm.data.shards import token_dtype

    assert [token_dtype(v).name for v in (8192, 2**16, 2**16 + 1, 2**32)] == ["uint16", "uint16", "uint32", "uint32"]
    with pytest.raises(ValueError, match="does not fit"):
        token_dtype(2**32 + 1)
