"""Data pipeline: tokenizer, prepare_data layout and errors, PackedLoader order, resume and sharding."""

from __future__ import annotations

import gc
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from hydra_lm.cli import build_parser
from hydra_lm.data import HydraTokenizer, PackedLoader, load_tokenizer, prepare_data, read_meta
from hydra_lm.data.prepare import in_val
from hydra_lm.data.sources import default_corpus

WORDS = "alpha beta gamma delta epsilon zeta theta lambda sigma omega river stone cloud".split()


def _texts(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [f"# file {i}\n" + " ".join(rng.choice(WORDS, size=int(rng.integers(20, 120)))) + "\n" for i in range(n)]


def _write_corpus(root, n: int = 40):
    root.mkdir(parents=True, exist_ok=True)
    for i, text in enumerate(_texts(n)):
        sub = root / ("pkg" if i % 3 else "docs")
        sub.mkdir(exist_ok=True)
        (sub / f"f{i:02d}.txt").write_text(text, encoding="utf-8")
    return root


def _token_shard(path, lengths, start=3, vocab_size=None):
    """Pre-tokenized documents whose ids are all distinct, so a row can be identified by its tokens."""
    ids = np.arange(start, start + sum(lengths))
    docs = [torch.from_numpy(d) for d in np.split(ids, np.cumsum(lengths)[:-1])]
    obj = {"input_ids": docs} if vocab_size is None else {"input_ids": docs, "vocab_size": vocab_size}
    torch.save(obj, path)
    return path


@pytest.fixture(scope="module")
def text_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("text")
    src = _write_corpus(root / "src")
    return prepare_data([str(src)], root / "out", vocab_size=320, val_fraction=0.2, progress=False), src


@pytest.fixture(scope="module")
def token_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    rng = np.random.default_rng(1)
    _token_shard(root / "shard.pt", [int(x) for x in rng.integers(5, 60, size=120)])
    return prepare_data([str(root / "shard.pt")], root / "out", val_fraction=0.0, progress=False)


# tokenizer ---------------------------------------------------------------------------------------
def test_tokenizer_round_trip(tmp_path, monkeypatch):
    tok = HydraTokenizer.train(_texts(30), vocab_size=300)
    assert (tok.eos_id, tok.bos_id, tok.pad_id) == (0, 1, 2) and tok.vocab_size <= 300
    samples = ["def f(x):\n    return x  # ok\n", "Grüße, 世界! \t tabs\r\n", "",
               "quoting <|endoftext|> and <|pad|>"]
    for text in samples:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.eos_id not in tok.encode("a <|endoftext|> b"), "text must not forge a document boundary"
    again = load_tokenizer(tok.save(tmp_path))
    assert again.encode(samples[1]) == tok.encode(samples[1]) and again.eos_id == tok.eos_id
    assert [a.tolist() for a in tok.encode_arrays(samples)] == [tok.encode(s) for s in samples]
    snapshot = tmp_path / "hub" / "models--org--tiny" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    tok.save(snapshot)
    (tmp_path / "hub" / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--tiny" / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert load_tokenizer("org/tiny").encode(samples[0]) == tok.encode(samples[0])


def test_a_continuation_keeps_the_space_a_metaspace_tokenizer_puts_before_its_first_word(tmp_path):
    """SentencePiece-style tokenizers (Llama's, T5's tokenizer.json) mark a word's leading space on its first
    token, and their decoder drops it at the start of a text: a continuation decoded alone loses it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from hydra_lm.infer.runs import continuation

    spm = Tokenizer(models.BPE(unk_token="<unk>"))
    spm.pre_tokenizer, spm.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    spm.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 50,
                            trainers.BpeTrainer(vocab_size=60, special_tokens=["<eos>", "<unk>"]))
    spm.save(str(tmp_path / "spm.json"))
    for tok in (HydraTokenizer.from_file(tmp_path / "spm.json"), HydraTokenizer.train(_texts(30), vocab_size=300)):
        whole, prompt = tok.encode("the quick brown fox"), tok.encode("the quick")
        assert whole[:len(prompt)] == prompt
        assert "the quick" + continuation(tok, prompt, whole[len(prompt):]) == "the quick brown fox"


# prepare -----------------------------------------------------------------------------------------
def test_prepare_layout(text_data):
    out, src = text_data
    meta = read_meta(out)
    for name in ("train.bin", "val.bin", "train.idx.npy", "val.idx.npy", "tokenizer.json", "meta.json"):
        assert (out / name).is_file(), name
    assert meta["dtype"] == "uint16" and meta["vocab_size"] <= 320 and meta["eos_id"] == 0
    assert meta["num_documents"] == 40 == sum(s["documents"] for s in meta["splits"].values())
    tok = load_tokenizer(out)
    originals = {p.read_text(encoding="utf-8") for p in src.rglob("*.txt")}
    for split, info in meta["splits"].items():
        tokens = np.fromfile(out / f"{split}.bin", dtype=np.uint16)
        starts = np.load(out / f"{split}.idx.npy")
        assert len(tokens) == info["tokens"] and len(starts) == info["documents"] >= 1
        assert starts.dtype == np.int64 and (tokens[starts] == meta["eos_id"]).all() and tokens[-1] == meta["eos_id"]
        assert int(tokens.max()) < meta["vocab_size"]
        ends = list(starts[1:]) + [len(tokens) - 1]
        for s, e in zip(starts, ends):  # every document decodes back to one whole input file
            assert tok.decode(tokens[s + 1:e]) in originals


def test_prepare_rerun_is_noop_and_options_rebuild(tmp_path, capsys):
    src = _write_corpus(tmp_path / "src", n=12)
    out = prepare_data([str(src)], tmp_path / "out", vocab_size=300, val_fraction=0.25)
    stamp = (out / "train.bin").stat().st_mtime_ns
    capsys.readouterr()
    prepare_data([str(src)], tmp_path / "out", vocab_size=300, val_fraction=0.25)
    assert "skipped" in capsys.readouterr().out
    assert (out / "train.bin").stat().st_mtime_ns == stamp
    prepare_data([str(src)], tmp_path / "out", vocab_size=300, val_fraction=0.5, progress=False)
    assert read_meta(out)["options"]["val_fraction"] == 0.5
    inner = prepare_data([str(src)], src / "prepared", vocab_size=300, progress=False)
    shutil.copytree(inner, src / "copy_of_prepared")
    assert prepare_data([str(src)], src / "prepared", vocab_size=300, progress=False) == inner
    assert read_meta(inner)["num_documents"] == 12, "prepared outputs inside the inputs are not inputs"
    globbed = prepare_data([str(src / "*")], tmp_path / "globbed", vocab_size=300, progress=False)
    assert read_meta(globbed)["num_documents"] == 12, "nor where a pattern reaches them"
    with pytest.raises(ValueError, match="is prepared data"):
        prepare_data([str(inner)], tmp_path / "again", vocab_size=300, progress=False)
    assert not list(out.glob(".*tmp*")), "temporary files must be renamed or removed"


def test_val_split_is_by_file_and_stable(tmp_path):
    a = _write_corpus(tmp_path / "one" / "corpus")
    b = tmp_path / "elsewhere" / "copy"
    shutil.copytree(a, b)
    out_a = prepare_data([str(a)], tmp_path / "oa", vocab_size=300, val_fraction=0.3, progress=False)
    out_b = prepare_data([str(b)], tmp_path / "ob", vocab_size=300, val_fraction=0.3, progress=False)
    va, vb = (np.fromfile(o / "val.bin", dtype=np.uint16) for o in (out_a, out_b))
    assert len(va) > 0 and np.array_equal(va, vb)
    keys = sorted(p.relative_to(a).as_posix() for p in a.rglob("*.txt"))
    expected = [k for k in keys if in_val(k, 0, 0.3)]
    assert read_meta(out_a)["splits"]["val"]["documents"] == len(expected)
    assert [k for k in keys if in_val(k, 1, 0.3)] != expected, "the seed salts the hold-out"


@pytest.mark.parametrize("hashed_into", ["train", "val"])
def test_a_corpus_of_one_document_is_cut_for_its_validation_split(tmp_path, hashed_into):
    """One text file is one document, so the hash split leaves one split empty: its tail becomes the validation
    split (and a file whose name hashes into validation still trains)."""
    name = next(f"corpus{i}.txt" for i in range(1000) if in_val(f"corpus{i}.txt", 0, 0.05) == (hashed_into == "val"))
    text = " ".join(_texts(40))
    (tmp_path / name).write_text(text, encoding="utf-8")
    out = prepare_data([str(tmp_path / name)], tmp_path / "out", vocab_size=300, val_fraction=0.05, progress=False)
    meta = read_meta(out)
    train, val = (meta["splits"][s] for s in ("train", "val"))
    assert train["documents"] == val["documents"] == 1
    assert 0.03 < (val["tokens"] - 2) / (train["tokens"] + val["tokens"] - 4) < 0.07  # each split: eos + doc + eos
    ids = [np.fromfile(out / f"{s}.bin", dtype=np.uint16)[1:-1].tolist() for s in ("train", "val")]
    assert load_tokenizer(out).decode(ids[0] + ids[1]) == text  # the document's head, then its tail
    assert "last" in meta["val_holdout"]
    (tmp_path / "short").mkdir()
    (tmp_path / "short" / name).write_text("a", encoding="utf-8")
    short = prepare_data([str(tmp_path / "short" / name)], tmp_path / "out_short", tokenizer=out, val_fraction=0.05,
                         progress=False)
    assert read_meta(short)["splits"]["train"]["documents"] == 1, "too short to cut, it trains"


@pytest.mark.parametrize("docs, hashed_into", [(5, "val"), (5, "train"), (1, "train")])
def test_the_tokenizer_learns_only_text_that_ends_up_in_train(tmp_path, docs, hashed_into):
    """Where the hash split leaves a split empty, a document (of a one-document corpus: its tail) changes split
    after the hash; the tokenizer must not have learnt it. A word is one token only where the tokenizer saw it."""
    words = ["abcde", "fghij", "klmno", "pqrst", "uvwxy"]
    names = [n for i in range(3000) if in_val(n := f"d{i:04d}.txt", 0, 0.1) == (hashed_into == "val")][:docs]
    texts = [f"{w} " * 60 for w in words] if docs > 1 else ["abcde " * 100 + "uvwxy " * 4]
    (tmp_path / "src").mkdir()
    for name, text in zip(names, texts):
        (tmp_path / "src" / name).write_text(text, encoding="utf-8")
    out = prepare_data([str(tmp_path / "src")], tmp_path / "out", vocab_size=400, val_fraction=0.1, progress=False)
    tok = load_tokenizer(out)
    split_text = {s: tok.decode(np.fromfile(out / f"{s}.bin", dtype=np.uint16).tolist()) for s in ("train", "val")}
    in_train = {w for w in words if w in split_text["train"]}
    assert {w for w in words if w in split_text["val"]} - in_train, "some words only validate"
    assert {w for w in words if len(tok.encode(" " + w)) == 1} == in_train


def test_gzipped_token_shards_read_like_plain_ones_and_a_damaged_gzip_is_one_clear_error(tmp_path):
    import gzip

    plain, packed = tmp_path / "plain", tmp_path / "packed"
    plain.mkdir(), packed.mkdir()
    _token_shard(plain / "a.pt", [7, 9, 4])
    np.save(plain / "b.npy", np.arange(3, 40))
    for name in ("a.pt", "b.npy"):
        (packed / f"{name}.gz").write_bytes(gzip.compress((plain / name).read_bytes()))
    outs = [prepare_data([str(d)], tmp_path / f"out_{d.name}", val_fraction=0.0, progress=False)
            for d in (plain, packed)]
    assert np.array_equal(*(np.fromfile(o / "train.bin", dtype=np.uint16) for o in outs))
    text = "\n".join(json.dumps({"text": t}) for t in _texts(40)).encode()
    for name, data in (("cut.jsonl.gz", gzip.compress(text)[:-20]), ("fake.txt.gz", text)):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ValueError, match=f"{name}: corrupt or truncated gzip file"):
            prepare_data([str(tmp_path / name)], tmp_path / f"out_{name}", vocab_size=300, progress=False)


def test_jsonl_input_and_text_field(tmp_path):
    rows = [{"text": t, "id": i} for i, t in enumerate(_texts(30))]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n", encoding="utf-8")
    out = prepare_data([str(tmp_path / "a.jsonl")], tmp_path / "out", vocab_size=300, progress=False)
    meta = read_meta(out)
    assert meta["num_documents"] == 30 and meta["splits"]["val"]["documents"] >= 1
    (tmp_path / "b.jsonl").write_text(json.dumps({"body": "x"}) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match="text_field"):
        prepare_data([str(tmp_path / "b.jsonl")], tmp_path / "out_b", vocab_size=300, progress=False)
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in _texts(5)), encoding="utf-8")
    out_c = prepare_data([str(tmp_path / "c.jsonl")], tmp_path / "out_c", vocab_size=300, text_field="body",
                         val_fraction=0.0, progress=False)
    assert read_meta(out_c)["splits"]["train"]["documents"] == 5
    (tmp_path / "d.json").write_text(json.dumps([{"text": t} for t in _texts(4)]), encoding="utf-8")
    out_d = prepare_data([str(tmp_path / "d.json")], tmp_path / "out_d", vocab_size=300, val_fraction=0.0,
                         progress=False)
    assert read_meta(out_d)["num_documents"] == 4
    with pytest.raises(ValueError, match="text_field"):
        prepare_data([str(tmp_path / "d.json")], tmp_path / "out_e", vocab_size=300, text_field="body", progress=False)


def test_pt_shards_as_is_and_with_tokenizer(tmp_path, text_data):
    _token_shard(tmp_path / "s1.pt", [10, 20, 30], vocab_size=500)
    torch.save(torch.arange(5, 50).view(3, 15), tmp_path / "s2.pt")
    out = prepare_data([str(tmp_path)], tmp_path / "out", val_fraction=0.0, progress=False)
    meta = read_meta(out)
    assert meta["tokenizer"] is None and meta["eos_id"] == 500 and meta["vocab_size"] == 501
    assert meta["num_documents"] == 6
    tokens = np.fromfile(out / "train.bin", dtype=np.uint16)
    assert list(tokens[:3]) == [500, 3, 4] and tokens[-1] == 500
    with pytest.raises(ValueError, match="without a tokenizer"):
        load_tokenizer(out)
    tok_dir = text_data[0]
    (tmp_path / "small").mkdir()
    _token_shard(tmp_path / "small" / "ok.pt", [4, 4], start=5)
    out2 = prepare_data([str(tmp_path / "small")], tmp_path / "out2", tokenizer=tok_dir, val_fraction=0.0,
                        progress=False)
    assert read_meta(out2)["eos_id"] == 0 and read_meta(out2)["tokenizer"]["kind"] == "tokenizers"
    big = _token_shard(tmp_path / "big.pt", [5], start=1000)
    with pytest.raises(ValueError, match="other tokenizer"):  # ids of 1000+ against a ~320 vocab
        prepare_data([str(big)], tmp_path / "out3", tokenizer=tok_dir, progress=False)


def test_a_tokenizer_whose_ids_have_holes_keeps_its_ids(tmp_path):
    """A vocabulary's size is its largest id + 1, not its count of entries (id 70000 of 5 entries was wrapped into
    uint16 as 4464); a tokenizer that gives out ids above the size it reports is refused, by name."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2, "zz": 70000}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "src").mkdir()
    for i in range(4):
        (tmp_path / "src" / f"d{i}.txt").write_text("a zz b a zz\n")
    out = prepare_data([str(tmp_path / "src")], tmp_path / "out", tokenizer=tmp_path / "tokenizer.json",
                       val_fraction=0.0, progress=False)
    meta, tok = read_meta(out), load_tokenizer(out)
    assert meta["vocab_size"] == tok.vocab_size == 70001 and meta["dtype"] == "uint32"
    assert np.fromfile(out / "train.bin", dtype=np.uint32)[1:6].tolist() == tok.encode("a zz b a zz")
    assert tok.encode("zz") == [70000]

    class Underreporting(HydraTokenizer):
        vocab_size = 3

    lying = Underreporting(tok.backend, tok.kind, "holes.json", tok.eos_id, tok.bos_id, tok.pad_id)
    with pytest.raises(ValueError, match="tokenizer holes.json produced token id 70000, outside its vocabulary"):
        prepare_data([str(tmp_path / "src")], tmp_path / "out2", tokenizer=lying, val_fraction=0.0, progress=False)


def test_an_interrupted_preparation_is_not_read_as_a_corpus(tmp_path, token_data):
    """Shards without meta.json (a `prepare` that died) are refused, and their index (document starts, not
    tokens) is never read as token shards, named or found in a corpus."""
    broken = tmp_path / "corpus" / "old_out"
    shutil.copytree(token_data, broken)
    (broken / "meta.json").unlink()
    with pytest.raises(ValueError, match="incomplete `hydra-lm prepare` output.*prepare it again from its corpus"):
        prepare_data([str(broken)], tmp_path / "out", progress=False)
    with pytest.raises(ValueError, match="document index of prepared data"):
        prepare_data([str(broken / "train.idx.npy")], tmp_path / "out", progress=False)
    _token_shard(tmp_path / "corpus" / "shard.pt", [5, 6, 7])
    out = prepare_data([str(tmp_path / "corpus")], tmp_path / "out", val_fraction=0.0, progress=False)
    assert read_meta(out)["num_documents"] == 3


@pytest.mark.parametrize("inputs", ["blank text, a tokenizer", "empty token shards"])
def test_inputs_without_a_document_are_refused_clearly(tmp_path, text_data, inputs):
    if inputs.startswith("blank"):
        path, kw = tmp_path / "blank.txt", {"tokenizer": text_data[0]}
        path.write_text("   \n\n")
    else:
        path, kw = tmp_path / "empty.pt", {}
        torch.save(torch.zeros(0, dtype=torch.long), path)
    with pytest.raises(ValueError, match="no training documents"):
        prepare_data([str(path)], tmp_path / "out", progress=False, **kw)


def test_binary_or_utf16_text_files_are_reported(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    (src / "notes.txt").write_text("hello world, some text\n" * 200, encoding="utf-16")
    with pytest.raises(ValueError, match="notes.txt looks binary or UTF-16: convert it to UTF-8"):
        prepare_data([str(src / "notes.txt")], tmp_path / "out", vocab_size=300, progress=False)
    with pytest.raises(ValueError, match="the inputs are empty .1 file.s. were skipped as binary or UTF-16"):
        prepare_data([str(src)], tmp_path / "out", vocab_size=300, progress=False)
    _write_corpus(src, n=6)
    out = prepare_data([str(src)], tmp_path / "out", vocab_size=300, progress=False)
    assert read_meta(out)["num_documents"] == 6
    assert "skipped 1 file(s) that look binary or UTF-16" in capsys.readouterr().err


def test_a_killed_preparations_temporary_files_are_removed(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait()
    live = f".val.bin.tmp-{os.getppid()}"
    for name in (f".train.bin.tmp-{dead.pid}", f".meta.json.tmp-{dead.pid}", live):
        (out / name).write_bytes(b"partial")
    prepare_data([str(_write_corpus(tmp_path / "src", n=6))], out, vocab_size=300, progress=False)
    assert sorted(p.name for p in out.glob(".*tmp*")) == [live], "a live writer's files stay"


def test_named_set_through_env(tmp_path, monkeypatch):
    (tmp_path / "hydra_small_chat_pt").mkdir()
    _token_shard(tmp_path / "hydra_small_chat_pt" / "part0.pt", [8, 9, 10])
    for var in ("HYDRA_SMALL_CHAT_PT_DIR", "HYDRA_DATA_ROOT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(FileNotFoundError, match="HYDRA_DATA_ROOT"):
        prepare_data(["small_chat"], tmp_path / "out", progress=False)
    monkeypatch.setenv("HYDRA_DATA_ROOT", str(tmp_path))
    out = prepare_data(["small_chat"], tmp_path / "out", val_fraction=0.0, progress=False)
    assert read_meta(out)["num_documents"] == 3
    monkeypatch.setenv("HYDRA_SMALL_CHAT_PT_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="HYDRA_SMALL_CHAT_PT_DIR"):
        prepare_data(["small_chat"], tmp_path / "out", progress=False)


def test_default_corpus_discovery_capped(tmp_path):
    corpus = default_corpus(cap=300_000)
    assert corpus.notes["capped"] and corpus.total_bytes <= 300_000 and len(corpus.sources) > 5
    assert all(s.key.endswith(".py") and "site-packages" not in s.key for s in corpus.sources)
    assert [s.key for s in default_corpus(cap=300_000).sources] == [s.key for s in corpus.sources]
    out = prepare_data(None, tmp_path / "std", vocab_size=400, max_bytes=300_000, progress=False)
    meta = read_meta(out)
    assert meta["source"]["capped"] and meta["source"]["files_used"] == len(corpus.sources)
    assert meta["splits"]["train"]["tokens"] > 10_000


def test_bad_inputs_raise_clear_errors(tmp_path, monkeypatch):
    out = tmp_path / "out"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        prepare_data([str(tmp_path / "missing.txt")], out, progress=False)
    with pytest.raises(FileNotFoundError, match="matches no files"):
        prepare_data([str(tmp_path / "*.nothing")], out, progress=False)
    with pytest.raises(ValueError, match="empty list"):
        prepare_data([], out, progress=False)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("  \n")
    with pytest.raises(ValueError, match="no training text"):
        prepare_data([str(tmp_path / "empty")], out, progress=False)
    (tmp_path / "nothing").mkdir()
    with pytest.raises(ValueError, match="no supported files"):
        prepare_data([str(tmp_path / "nothing")], out, progress=False)
    with pytest.raises(ValueError, match="choose an --out outside the inputs"):
        prepare_data([str(tmp_path / "empty")], tmp_path / "empty", progress=False)
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01\x02" * 100)
    with pytest.raises(ValueError, match="unknown input type"):
        prepare_data([str(tmp_path / "blob.bin")], out, progress=False)
    (tmp_path / "t.txt").write_text("some text\n")
    with pytest.raises(ValueError, match="too small"):
        prepare_data([str(tmp_path / "t.txt")], out, vocab_size=100, progress=False)
    with pytest.raises(ValueError, match="val_fraction"):
        prepare_data([str(tmp_path / "t.txt")], out, val_fraction=1.5, progress=False)
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(ValueError, match="not valid JSON"):
        prepare_data([str(tmp_path / "bad.jsonl")], out, progress=False)
    torch.save(torch.rand(4), tmp_path / "float.pt")
    with pytest.raises(ValueError, match="integers"):
        prepare_data([str(tmp_path / "float.pt")], out, progress=False)
    with pytest.raises(ValueError, match="mix text and pre-tokenized"):
        prepare_data([str(tmp_path / "t.txt"), str(_token_shard(tmp_path / "k.pt", [3]))], out, progress=False)
    # optional packages: a clear message naming the package, whether or not it is installed here
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ValueError, match="pyarrow"):
        prepare_data([str(tmp_path / "d.parquet")], out, progress=False)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    with pytest.raises(ValueError, match="datasets.*local files"):
        prepare_data(["hf:some/dataset:default:train"], out, progress=False)
    monkeypatch.setitem(sys.modules, "tiktoken", None)
    with pytest.raises(ValueError, match="tiktoken"):
        prepare_data([str(tmp_path / "t.txt")], out, tokenizer="tiktoken:gpt2", progress=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf_cache"))
    with pytest.raises(ValueError, match="local cache"):
        load_tokenizer("some-org/not-downloaded-model")
    (tmp_path / "tokenizer_tiktoken.json").write_text('{"encoding": "gpt2"}')
    with pytest.raises(ValueError, match="is not a tiktoken record"):
        load_tokenizer(tmp_path / "tokenizer_tiktoken.json")
    assert not out.exists() or not (out / "meta.json").exists()


# loader ------------------------------------------------------------------------------------------
def _rows(batch) -> list[tuple]:
    return [tuple(r) for r in batch["input_ids"].tolist()]


def _same(a, b) -> bool:
    return all(torch.equal(a[k], b[k]) for k in ("input_ids", "targets", "doc_ids"))


def test_loader_batches_shapes_and_doc_ids(token_data):
    meta = read_meta(token_data)
    loader = PackedLoader(token_data, "train", batch_size=4, seq_len=32, seed=3)
    for _ in range(10):
        b = next(loader)
        assert b["input_ids"].shape == b["targets"].shape == b["doc_ids"].shape == (4, 32)
        assert b["input_ids"].dtype == b["targets"].dtype == torch.int64 and b["doc_ids"].dtype == torch.int32
        assert torch.equal(b["targets"][:, :-1], b["input_ids"][:, 1:])
        starts = (b["input_ids"] == meta["eos_id"]).int()
        expected = torch.cumsum(starts, dim=1) - starts[:, :1]  # a document begins at its separator
        assert torch.equal(b["doc_ids"], expected.int()) and (b["doc_ids"][:, 0] == 0).all()


def test_loader_order_is_deterministic(text_data):
    a = PackedLoader(text_data[0], "train", batch_size=2, seq_len=16, seed=5)
    b = PackedLoader(text_data[0], "train", batch_size=2, seq_len=16, seed=5)
    c = PackedLoader(text_data[0], "train", batch_size=2, seq_len=16, seed=6)
    xs, ys, zs = ([next(x) for _ in range(6)] for x in (a, b, c))
    assert all(_same(x, y) for x, y in zip(xs, ys)) and not all(_same(x, z) for x, z in zip(xs, zs))


@pytest.mark.parametrize("threads", [0, 2])
def test_loader_state_round_trip(token_data, threads):
    kw = dict(batch_size=3, seq_len=24, seed=11, prefetch_threads=threads, prefetch_buffer_size=4)
    first = PackedLoader(token_data, "train", **kw)
    per_epoch = first.steps_per_epoch()
    for _ in range(per_epoch - 2):  # stop shortly before an epoch boundary
        next(first)
    state = json.loads(json.dumps(first.state_dict()))
    expected = [next(first) for _ in range(6)]
    assert first.epoch == 1
    resumed = PackedLoader(token_data, "train", **{**kw, "seed": 0})  # the seed comes from the state
    resumed.load_state_dict(state)
    got = [next(resumed) for _ in range(6)]
    assert all(_same(x, y) for x, y in zip(expected, got))
    assert resumed.state_dict() == first.state_dict()
    first.close(), resumed.close()


def test_dropping_a_prefetching_loader_stops_its_threads(token_data):
    before = set(threading.enumerate())
    gc.disable()  # the threads must stop without a garbage collection
    try:
        loader = PackedLoader(token_data, "train", batch_size=2, seq_len=16, prefetch_threads=2)
        next(loader)
        threads = [t for t in threading.enumerate() if t not in before and t.name.startswith("hydra-prefetch")]
        assert threads
        del loader
        deadline = time.monotonic() + 10
        while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        gc.enable()
    assert not any(t.is_alive() for t in threads)


def test_rank_sharding_is_disjoint_and_covers_epoch(token_data):
    kw = dict(batch_size=2, seq_len=20, seed=7)
    ranks = [PackedLoader(token_data, "train", rank=r, world_size=2, **kw) for r in range(2)]
    single = PackedLoader(token_data, "train", **{**kw, "batch_size": 4})
    steps = ranks[0].steps_per_epoch()
    assert steps == ranks[1].steps_per_epoch() == single.steps_per_epoch() > 3
    seen = [[], []]
    for _ in range(steps):
        parts = [_rows(next(loader)) for loader in ranks]
        for r in range(2):
            seen[r] += parts[r]
        assert sorted(parts[0] + parts[1]) == sorted(_rows(next(single)))
    assert not set(seen[0]) & set(seen[1]) and len(set(seen[0] + seen[1])) == 4 * steps
    tokens = {t for row in seen[0] + seen[1] for t in row}
    n_tokens = read_meta(token_data)["splits"]["train"]["tokens"]
    assert len(tokens) >= n_tokens - 20 * (4 + 1) - 121  # all but the remainder rows (+ repeated separators)
    # elastic resume: a two-rank state continues on one rank over the epoch's remaining rows
    half = PackedLoader(token_data, "train", **kw, rank=0, world_size=2)
    for _ in range(2):
        next(half)
    one = PackedLoader(token_data, "train", **{**kw, "batch_size": 4})
    one.load_state_dict(half.state_dict())
    ref = PackedLoader(token_data, "train", **{**kw, "batch_size": 4})
    next(ref), next(ref)
    assert _same(next(one), next(ref))


def test_eval_pass_covers_every_token_once(text_data):
    out = text_data[0]
    n = read_meta(out)["splits"]["val"]["tokens"]
    for world in (1, 2):
        counted, passes = 0, []
        for rank in range(world):
            loader = PackedLoader(out, "val", batch_size=3, seq_len=16, rank=rank, world_size=world, loop=False)
            batches = list(loader)
            assert len(batches) == len(loader) and all(b["input_ids"].shape == (3, 16) for b in batches)
            counted += sum(int((b["targets"] != -100).sum()) for b in batches)
            again = list(loader)  # a finished pass restarts identically
            assert len(again) == len(batches) and all(_same(x, y) for x, y in zip(batches, again))
            passes.append(len(batches))
        assert counted == n - 1 and len(set(passes)) == 1


def test_loader_errors(tmp_path, text_data):
    with pytest.raises(FileNotFoundError, match="hydra-lm prepare") as missing:
        PackedLoader(tmp_path / "nope", "train", batch_size=1, seq_len=8)
    hinted = re.search(r"`hydra-lm (prepare [^`]*)`", str(missing.value)).group(1).replace("PATH...", "corpus.txt")
    args = build_parser().parse_args(hinted.replace("DIR", "out").split())
    assert args.inputs == ["corpus.txt"] and args.out == "out"  # the hint's command is one the CLI accepts
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="hydra-lm prepare"):
        PackedLoader(tmp_path / "empty", "train", batch_size=1, seq_len=8)
    with pytest.raises(ValueError, match="unknown split"):
        PackedLoader(text_data[0], "test", batch_size=1, seq_len=8)
    with pytest.raises(ValueError, match="fewer than batch_size"):
        PackedLoader(text_data[0], "val", batch_size=512, seq_len=64)
    with pytest.raises(ValueError, match=r"about 0 rows of seq_len=100000 \(the split is shorter than seq_len\)"):
        PackedLoader(text_data[0], "val", batch_size=1, seq_len=100_000)
    with pytest.raises(ValueError, match="rank"):
        PackedLoader(text_data[0], "train", batch_size=1, seq_len=8, rank=2, world_size=2)
    broken = tmp_path / "broken"
    shutil.copytree(text_data[0], broken)
    meta = json.loads((broken / "meta.json").read_text())
    meta["vocab_size"] = 10
    (broken / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="vocab_size"):
        PackedLoader(broken, "train", batch_size=1, seq_len=8)
    for damaged in ({"eos_id": None}, {"splits": []}):  # valid JSON of the wrong shape
        (broken / "meta.json").write_text(json.dumps({**meta, **damaged}))
        key = next(iter(damaged))
        with pytest.raises(ValueError, match=f"lacks a valid '{key}'.*prepare it again"):
            PackedLoader(broken, "train", batch_size=1, seq_len=8)
    damaged = tmp_path / "damaged"
    shutil.copytree(text_data[0], damaged)
    (damaged / "train.idx.npy").write_bytes(b"")  # an empty index raised a bare EOFError
    with pytest.raises(ValueError, match="not a plain integer array.*prepare the data again"):
        PackedLoader(damaged, "train", batch_size=1, seq_len=8)
    other = PackedLoader(text_data[0], "train", batch_size=1, seq_len=8)
    with pytest.raises(ValueError, match="seq_len"):
        other.load_state_dict({**other.state_dict(), "seq_len": 9})
    with pytest.raises(ValueError, match="other data"):
        other.load_state_dict({**other.state_dict(), "data_fingerprint": "x", "data_content": "x"})


def test_a_partial_evaluation_samples_the_whole_validation_split(tmp_path):
    from hydra_lm.train.data_io import ValSet, open_data
    # Token ids grow along the corpus, so a row's ids say where in the split it lies; unshuffled, the first batches
    # of a pass would all come from its first files (the split keeps the corpus order).
    rng = np.random.default_rng(2)
    _token_shard(tmp_path / "shard.pt", [int(x) for x in rng.integers(20, 60, size=200)])
    out = prepare_data([str(tmp_path / "shard.pt")], tmp_path / "out", val_fraction=0.3, progress=False)
    n, eos = read_meta(out)["splits"]["val"]["tokens"], read_meta(out)["eos_id"]
    val = ValSet(open_data(out), batch_size=4, seq_len=16)
    batches = list(val)
    ids = np.asarray(PackedLoader(out, "val", batch_size=4, seq_len=16, loop=False).tokens)
    third, two_thirds = np.quantile(ids[ids != eos], [1 / 3, 2 / 3])  # the documents' own tokens
    first = torch.cat([b["input_ids"] for b in batches[:3]])  # 12 of the split's ~150 rows
    rows = torch.where(first == eos, 0, first).amax(1)
    assert (rows < third).any() and (rows > two_thirds).any()
    # Still one whole pass: every token once, and the same pass again on the next iteration.
    assert sum(int((b["targets"] != -100).sum()) for b in batches) == n - 1
    assert all(_same(x, y) for x, y in zip(batches, list(val)))
    next(iter(val))  # an evaluation of fewer batches (--eval_batches) stops early: the next starts the pass again
    assert all(_same(x, y) for x, y in zip(batches[:2], (b for _, b in zip(range(2), val))))


def test_every_input_flag_adds_to_one_list():
    """``--input`` and ``--inputs`` spell one option: repeated, each adds its paths (a later one used to replace
    the earlier ones, silently preparing part of the corpus)."""
    from hydra_lm.cli import build_parser
    parse = build_parser().parse_args
    assert parse(["prepare", "--inputs", "a", "--input", "b", "c", "--out", "o"]).inputs == ["a", "b", "c"]
    assert parse(["prepare", "--out", "o"]).inputs is None
