"""What prepare reads from its inputs: JSON in its several layouts, Parquet columns, encodings, token shards,
linked directories, and inputs that are refused with a clear error."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from hydra_lm.cli import main
from hydra_lm.data import HydraTokenizer, load_tokenizer, open_split, prepare_data, read_meta

WORDS = "alpha beta gamma delta epsilon zeta theta lambda sigma omega river stone cloud".split()


def _texts(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(20, 80)))) + "\n" for _ in range(n)]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A tokenizer to prepare with, so that each test's output holds exactly the text it read."""
    return HydraTokenizer.train(_texts(30) + ["café naïve — ü"], vocab_size=300).save(
        tmp_path_factory.mktemp("tok"))


def _documents(out) -> list[str]:
    """The text of every document of a prepared directory, train then val."""
    tok, meta = load_tokenizer(out), read_meta(out)
    docs = []
    for split in ("train", "val"):
        if not meta["splits"][split]["documents"]:
            continue
        tokens, starts = open_split(out, split, meta)
        ends = [*starts[1:], len(tokens) - 1]
        docs += [tok.decode(tokens[s + 1:e].tolist()) for s, e in zip(starts, ends)]
    return docs


def _prepare(inputs, out, tokenizer_dir, **kw):
    return prepare_data([str(i) for i in inputs], out, tokenizer=tokenizer_dir, val_fraction=0.0, progress=False,
                        **kw)


# JSON -------------------------------------------------------------------------------------------------
def test_json_lines_under_a_json_name_are_records(tmp_path, tokenizer_dir):
    """``datasets``' ``to_json`` writes JSON Lines named ``.json``: one document per record, named or found."""
    texts = _texts(5)
    (tmp_path / "data").mkdir()
    path = tmp_path / "data" / "train.json"
    path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)), encoding="utf-8")
    for given in (path, path.parent):
        out = _prepare([given], tmp_path / f"out_{given.name}", tokenizer_dir)
        assert sorted(_documents(out)) == sorted(texts)


def test_a_byte_order_mark_is_not_text(tmp_path, tokenizer_dir):
    texts = _texts(3)
    (tmp_path / "list.json").write_bytes(b"\xef\xbb\xbf" + json.dumps([{"text": t} for t in texts]).encode())
    (tmp_path / "notes.txt").write_bytes("\ufeffcafé alpha\n".encode())
    assert sorted(_documents(_prepare([tmp_path / "list.json"], tmp_path / "a", tokenizer_dir))) == sorted(texts)
    assert _documents(_prepare([tmp_path / "notes.txt"], tmp_path / "b", tokenizer_dir)) == ["café alpha\n"]


def test_a_named_json_file_that_is_not_json_is_refused_and_a_found_one_reads_as_text(tmp_path, tokenizer_dir):
    (tmp_path / "src").mkdir()
    broken = tmp_path / "src" / "settings.json"
    broken.write_text('{"name": "alpha",\n "trailing": "comma",}\n')
    with pytest.raises(ValueError, match=r"settings.json is neither JSON .* nor JSON Lines .line 1.*\.txt"):
        _prepare([broken], tmp_path / "out", tokenizer_dir)
    assert _documents(_prepare([tmp_path / "src"], tmp_path / "found", tokenizer_dir)) == [broken.read_text()]


def test_json_lines_records_without_the_text_field_name_it(tmp_path, tokenizer_dir):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps({"body": "alpha"}) + "\n" + json.dumps({"body": "beta"}) + "\n")
    with pytest.raises(ValueError, match=r"rows.json:1: record has no field 'text'.*--text_field NAME"):
        _prepare([path], tmp_path / "out", tokenizer_dir)
    out = _prepare([path], tmp_path / "out", tokenizer_dir, text_field="body")
    assert sorted(_documents(out)) == ["alpha", "beta"]


def test_json_records_without_the_text_field_read_as_text_are_warned_about_and_a_named_one_is_refused(
        tmp_path, tokenizer_dir, capsys):
    """A directory of data files whose text field has another name trained on their JSON syntax without a word: they
    still read as text (a code repository's .json configs are text), but prepare says so and how to name the field;
    one object without the field, named explicitly, is an error like a list or lines of them."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(2):
        (src / f"part{i}.json").write_text(json.dumps([{"content": t} for t in _texts(3, seed=i)]))
    (src / "notes.txt").write_text("alpha\n")
    out = _prepare([src], tmp_path / "out", tokenizer_dir)
    assert len(_documents(out)) == 3
    err = capsys.readouterr().err
    assert "warning: 2 .json file(s) hold records without a 'text' field, e.g." in err and "part0.json" in err
    assert "pass --text_field NAME" in err
    assert len(_documents(_prepare([src], tmp_path / "named", tokenizer_dir, text_field="content"))) == 7
    assert "records without" not in capsys.readouterr().err
    (tmp_path / "one.json").write_text(json.dumps({"content": "alpha"}))
    with pytest.raises(ValueError, match=r"one.json: record has no field 'text'.*--text_field NAME"):
        _prepare([tmp_path / "one.json"], tmp_path / "one", tokenizer_dir)


# encodings --------------------------------------------------------------------------------------------
def test_text_that_is_not_utf8_is_kept_with_a_warning(tmp_path, tokenizer_dir, capsys):
    src = tmp_path / "src"
    src.mkdir()
    (src / "latin1.txt").write_bytes("café alpha\n".encode("latin-1"))
    (src / "rows.jsonl").write_bytes(json.dumps({"text": "beta"}).encode() + b"\n"
                                     + b'{"text": "na\xefve gamma"}\n')
    (src / "clean.txt").write_text("delta\n")
    out = _prepare([src], tmp_path / "out", tokenizer_dir)
    assert sorted(_documents(out)) == ["beta", "caf\ufffd alpha\n", "delta\n", "na\ufffdve gamma"]
    err = capsys.readouterr().err
    assert "warning: 2 file(s) are not valid UTF-8, e.g." in err and "latin1.txt" in err
    assert "convert them to UTF-8" in err
    _prepare([src / "clean.txt"], tmp_path / "clean", tokenizer_dir)
    assert "UTF-8" not in capsys.readouterr().err


def test_utf16_jsonl_gets_the_utf16_hint(tmp_path, tokenizer_dir, capsys):
    (tmp_path / "src").mkdir()
    path = tmp_path / "src" / "rows.jsonl"
    path.write_text(json.dumps({"text": "alpha beta"}) + "\n", encoding="utf-16")
    with pytest.raises(ValueError, match="rows.jsonl looks binary or UTF-16: convert it to UTF-8"):
        _prepare([path], tmp_path / "out", tokenizer_dir)
    (tmp_path / "src" / "ok.txt").write_text("gamma\n")
    assert _documents(_prepare([tmp_path / "src"], tmp_path / "out", tokenizer_dir)) == ["gamma\n"]
    assert "skipped 1 file(s) that look binary or UTF-16" in capsys.readouterr().err


# Parquet ----------------------------------------------------------------------------------------------
def test_parquet_text_columns_and_columns_that_are_not_text(tmp_path, tokenizer_dir):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.table({"raw": pa.array([b"alpha beta", "caf\xe9".encode("latin-1"), None], pa.binary()),
                      "text": ["gamma", None, "delta"], "n": [1, 2, 3]})
    pq.write_table(table, tmp_path / "t.parquet")
    out = _prepare([tmp_path / "t.parquet"], tmp_path / "raw", tokenizer_dir, text_field="raw")
    assert sorted(_documents(out)) == ["alpha beta", "caf\ufffd"]
    assert sorted(_documents(_prepare([tmp_path / "t.parquet"], tmp_path / "text", tokenizer_dir))) == ["delta",
                                                                                                       "gamma"]
    with pytest.raises(ValueError, match=r"t.parquet row 0: column 'n' holds int, not text.*--text_field NAME"):
        _prepare([tmp_path / "t.parquet"], tmp_path / "n", tokenizer_dir, text_field="n")


def test_a_damaged_parquet_file_is_one_clear_error(tmp_path, tokenizer_dir):
    pytest.importorskip("pyarrow")
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not really parquet PAR1")
    with pytest.raises(ValueError, match="could not read .*bad.parquet as Parquet .*damaged or not Parquet"):
        _prepare([tmp_path / "bad.parquet"], tmp_path / "out", tokenizer_dir)


class _FakeDataset:
    """The part of a ``datasets.Dataset`` that prepare reads."""

    def __init__(self, rows: dict[str, list]):
        self.rows, self.column_names = rows, list(rows)

    def select_columns(self, names):
        return _FakeDataset({n: self.rows[n] for n in names})

    def iter(self, batch_size):
        n = len(next(iter(self.rows.values())))
        for i in range(0, n, batch_size):
            yield {k: v[i:i + batch_size] for k, v in self.rows.items()}


def test_hugging_face_columns_that_are_not_text_are_refused(tmp_path, tokenizer_dir, monkeypatch):
    import importlib.machinery
    import sys
    import types

    fake = types.ModuleType("datasets")
    fake.__spec__ = importlib.machinery.ModuleSpec("datasets", None)
    rows = {"text": ["gamma", None, "delta"], "n": [1, 2, 3]}
    fake.load_dataset = lambda name, config, split: _FakeDataset(rows)
    monkeypatch.setitem(sys.modules, "datasets", fake)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = _prepare(["hf:some/set"], tmp_path / "text", tokenizer_dir)
    assert sorted(_documents(out)) == ["delta", "gamma"]
    # a number column used to become empty documents, silently
    with pytest.raises(ValueError, match=r"hf:some/set row 0: column 'n' holds int, not text.*--text_field NAME"):
        _prepare(["hf:some/set"], tmp_path / "n", tokenizer_dir, text_field="n")


# token shards -----------------------------------------------------------------------------------------
def test_a_token_shard_with_ids_beyond_its_declared_vocabulary_is_refused(tmp_path):
    torch.save({"input_ids": [torch.tensor([5, 7]), torch.tensor([2000, 9])], "vocab_size": 1000}, tmp_path / "s.pt")
    with pytest.raises(ValueError, match=r"s.pt declares vocab_size 1000 but holds token id 2000"):
        prepare_data([str(tmp_path / "s.pt")], tmp_path / "out", val_fraction=0.0, progress=False)
    torch.save({"input_ids": [torch.tensor([5, 999])], "vocab_size": 1000}, tmp_path / "ok.pt")
    out = prepare_data([str(tmp_path / "ok.pt")], tmp_path / "ok", val_fraction=0.0, progress=False)
    assert read_meta(out)["vocab_size"] == 1001


# where inputs are -------------------------------------------------------------------------------------
def test_an_input_named_inside_the_output_directory_is_refused(tmp_path, tokenizer_dir):
    (tmp_path / "a.txt").write_text("alpha\n")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "b.txt").write_text("beta\n")
    for inputs in ([tmp_path / "a.txt", tmp_path / "out" / "b.txt"], [tmp_path / "a.txt", tmp_path / "out"]):
        with pytest.raises(ValueError, match=r"input '.*out.*' is inside the output directory .*choose an --out"):
            _prepare(inputs, tmp_path / "out", tokenizer_dir)
    # found by walking a directory that holds the output: left out, as the output is
    assert _documents(_prepare([tmp_path], tmp_path / "out", tokenizer_dir)) == ["alpha\n"]


def test_linked_directories_are_walked_once(tmp_path, tokenizer_dir):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "b.txt").write_text("beta\n")
    corpus = tmp_path / "corpus"
    (corpus / "own").mkdir(parents=True)
    (corpus / "own" / "b.txt").write_text("alpha\n")
    os.symlink(tmp_path / "elsewhere", corpus / "linked")
    os.symlink(tmp_path / "elsewhere", corpus / "linked_again")
    os.symlink(corpus, corpus / "own" / "up")  # a cycle
    out = _prepare([corpus], tmp_path / "out", tokenizer_dir)
    assert sorted(_documents(out)) == ["alpha\n", "beta\n"]


def test_globs_over_directories_saved_datasets_inside_and_unread_compressions(tmp_path, tokenizer_dir, capsys):
    """A glob may match a directory with nothing to read (it is skipped, not fatal); a dataset saved with
    ``save_to_disk`` below a walked directory is read as one, not its metadata as text; compressed files of a kind
    that is not read are named in a warning instead of vanishing."""
    from hydra_lm.data.sources import resolve_inputs

    corpus = tmp_path / "corpus"
    (corpus / "a").mkdir(parents=True)
    (corpus / "empty").mkdir()
    (corpus / "a" / "x.txt").write_text("alpha\n")
    (corpus / "big.jsonl.xz").write_bytes(b"\xfd7zXZ\x00")
    saved = corpus / "wiki_saved"
    saved.mkdir()
    for name in ("state.json", "dataset_info.json"):
        (saved / name).write_text("{}")
    (saved / "data-00000-of-00001.arrow").write_bytes(b"arrow")
    for spec in (corpus, f"{corpus}/*", f"{corpus}/**"):
        found = resolve_inputs([str(spec)])
        assert sorted((s.fmt, s.path.name) for s in found.sources) == [("hf_disk", "wiki_saved"), ("text", "x.txt")]
        assert found.compressed == {corpus / "big.jsonl.xz"}
    (saved / "state.json").unlink()  # a directory of two .json configs again: read as text
    _prepare([f"{corpus}/*"], tmp_path / "out", tokenizer_dir)
    err = capsys.readouterr().err
    assert "skipped 1 compressed file(s) of a kind that is not read, e.g." in err and "big.jsonl.xz" in err


def test_an_id_the_tokenizer_has_no_token_for_decodes_as_a_replacement_character(tokenizer_dir):
    """A model's vocabulary may be larger than its tokenizer's: a sampled id past it reads as U+FFFD, where Hugging
    Face's tokenizers dropped it silently and tiktoken raised after the whole batch was generated."""
    tok = load_tokenizer(tokenizer_dir)
    ab = tok.encode("ab")
    assert tok.decode([*ab, tok.vocab_size + 7, *ab]) == "ab\ufffdab"


# command line -----------------------------------------------------------------------------------------
def test_prepare_with_an_empty_input_list_is_refused(tmp_path, capsys):
    assert main(["prepare", "--input", "--out", str(tmp_path / "out"), "--no_progress"]) == 2
    assert "empty list" in capsys.readouterr().err
    assert not (tmp_path / "out" / "meta.json").exists(), "not the built-in corpus"


def test_train_dataset_without_the_text_field_says_how_to_prepare_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HYDRA_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "c.jsonl").write_text(json.dumps({"body": "alpha"}) + "\n")
    assert main(["train", "--dataset", str(tmp_path / "c.jsonl"), "--out", str(tmp_path / "run"),
                 "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "record has no field 'text'" in err and "--text_field NAME --out DIR` and train with --data DIR" in err
    assert "text_field=NAME" not in err, "train has no text_field option"
