"""Using a finished (or running) run: load its model from a checkpoint, evaluate it, sample from it."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from ..config import HydraConfig
from ..model.attention import kernels_for_device
from ..model.factory import create_model
from ..model.sampling import check_sampling
from ..train.checkpoint import EXPORT_FORMAT, Checkpoint, resolve_checkpoint, save_weights
from ..train.data_io import ValSet, open_data, tokenized_alike
from ..train.evaluate import evaluate
from ..train.run import CONFIG_JSON, pick_device
from ..train.sharded_checkpoint import load_dcp


@dataclass
class LoadedRun:
    run_dir: Path
    model: torch.nn.Module
    checkpoint: Checkpoint
    config: dict[str, Any]  # the run's config.json
    device: torch.device


def load_run(run_dir: str | Path, checkpoint: str | Path | None = None, device: str = "auto",
             adapt_kernels: bool = True) -> LoadedRun:
    """A run's checkpoint (``checkpoint``: a path, a name in the run's checkpoints directory, or None: the newest
    good one) as a model on ``device``. ``adapt_kernels``: kernel choices the run saved that ``device`` cannot run
    fall back to "auto" with a note (``kernels_for_device``); ``export_model`` keeps them as saved."""
    run_dir = Path(run_dir).expanduser()
    if not run_dir.is_dir():
        raise ValueError(f"run directory {run_dir} does not exist")
    ckpt = resolve_checkpoint(run_dir, checkpoint, warn=lambda msg: print(f"warning: {msg}", file=sys.stderr))
    config_path = run_dir / CONFIG_JSON
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except ValueError as err:
            raise ValueError(f"{config_path} is corrupt: {err}") from None
        if not isinstance(config, dict):
            raise ValueError(f"{config_path} is corrupt: not a JSON object")
        # The run's tokenizer decodes the checkpoint's tokens: one from another run would print wrong text.
        trained_with, run_with = (d.get("tokenizer_fingerprint") if isinstance(d, dict) else None
                                  for d in (ckpt.state.get("data"), config.get("data")))
        if None not in (trained_with, run_with) and trained_with != run_with:
            raise ValueError(f"checkpoint {ckpt.path} was trained with another tokenizer than run {run_dir}: pass "
                             "the --run it came from")
        # config.json holds the latest start's settings; a checkpoint saved before a resume that changed some (its
        # document masking, say) was trained with those it records itself.
        config = {**config, "train": ckpt.state.get("train_config") or config.get("train", {}),
                  "data": ckpt.state.get("data") or config.get("data", {})}
    else:  # a checkpoint copied out of its run carries its own config
        config = {"train": ckpt.state.get("train_config", {}), "model": ckpt.state.get("model_config"),
                  "data": ckpt.state.get("data", {})}
    model_values = ckpt.state.get("model_config") or config.get("model")
    if not model_values:
        raise ValueError(f"checkpoint {ckpt.path} holds no model config")
    dev = pick_device(device)
    try:
        model_config = HydraConfig.from_saved(model_values)
        if adapt_kernels:
            model_config, notes = kernels_for_device(model_config, dev)
            for note in notes:
                print(f"note: {note}", file=sys.stderr)
        model = create_model(model_config)
    except (ValueError, TypeError) as err:
        raise ValueError(f"checkpoint {ckpt.path} records an unusable model config: {err}") from None
    if ckpt.layout == "dcp":
        load_dcp(ckpt, model)
    else:
        ckpt.load_model(model)
    bad = next((name for name, p in model.named_parameters() if not torch.isfinite(p).all()), None)
    if bad is not None:
        raise ValueError(f"checkpoint {ckpt.path} holds non-finite weights ({bad} has NaN or Inf): it was saved from a "
                         f"diverged run; pick an earlier one with --checkpoint")
    model.to(dev).eval()
    curriculum = ckpt.state.get("curriculum")
    if curriculum is not None:  # evaluate the network as it was training at that step
        if not (isinstance(curriculum, dict) and {"mod_active", "mor_active"} <= set(curriculum)):
            raise ValueError(f"checkpoint {ckpt.path} records a malformed curriculum: pick another with --checkpoint")
        try:
            model.set_curriculum(mod_active=curriculum["mod_active"], mor_active=curriculum["mor_active"],
                                 mor_ramp=curriculum.get("mor_ramp", 1.0))
        except ValueError as err:
            raise ValueError(f"checkpoint {ckpt.path} records a malformed curriculum ({err}): pick another with "
                             "--checkpoint") from None
    return LoadedRun(run_dir, model, ckpt, config, dev)


def export_model(run_dir: str | Path, out: str | Path, checkpoint: str | Path | None = None) -> Path:
    """The full model of a checkpoint (any layout) as one safetensors file with its config in the metadata."""
    out = Path(out).expanduser()
    if out.suffix != ".safetensors":
        raise ValueError(f"--out {out}: name the file *.safetensors")
    if out.is_dir():  # before loading the model, and the rename over it would fail after writing the file
        raise ValueError(f"--out {out} is a directory: name a file, e.g. --out {out / 'model.safetensors'}")
    run = load_run(run_dir, checkpoint, "cpu", adapt_kernels=False)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    meta = {"format": EXPORT_FORMAT, "step": str(run.checkpoint.step),
            "model_config": json.dumps(run.model.config.to_dict()),
            "train_config": json.dumps(run.config.get("train", {})), "data": json.dumps(run.config.get("data", {})),
            "curriculum": json.dumps(run.checkpoint.state.get("curriculum"))}
    try:
        save_weights(run.model, tmp, metadata=meta)
    except SafetensorError as err:  # the writer's I/O errors come as this, not as OSError
        tmp.unlink(missing_ok=True)
        raise ValueError(f"cannot write {out}: {err}; check that its directory is writable and has room") from None
    tmp.replace(out)
    return out


def run_tokenizer(run: LoadedRun):
    """The tokenizer the run trained with: its own copy, else its data directory's; one whose fingerprint differs
    from the one the checkpoint records (replaced, e.g. by `hydra-lm prepare --out RUN_DIR`) is refused."""
    from ..data import load_tokenizer

    data = run.config.get("data") or {}
    data_path, recorded = data.get("path"), data.get("tokenizer_fingerprint")
    wrong = []
    for candidate in (run.run_dir / "tokenizer.json", run.run_dir / "tokenizer_tiktoken.json",
                      Path(data_path) if data_path else None):
        if candidate is not None and candidate.exists():
            try:
                tok = load_tokenizer(candidate)
            except FileNotFoundError:
                continue
            if recorded is None or tok.fingerprint() == recorded:
                return tok
            wrong.append(str(candidate))
    if wrong:
        raise ValueError(f"run {run.run_dir} was not trained with the tokenizer in {' or '.join(wrong)} (its "
                         "fingerprint differs from the one its checkpoint records): put back the tokenizer.json of "
                         "the data directory it trained on")
    if "tokenizer_fingerprint" in data and recorded is None:
        raise ValueError(f"run {run.run_dir} has no tokenizer (its data was pre-tokenized without one): text "
                         "generation needs a tokenizer")
    gone = f"its data directory {data_path} is gone" if data_path and not Path(data_path).exists() else \
        f"its data directory {data_path} holds none" if data_path else "it records no data directory"
    raise ValueError(f"run {run.run_dir} has no tokenizer: its tokenizer.json is missing and {gone}; put back the "
                     "tokenizer.json of the data directory it trained on")


def _autocast(device: torch.device):
    """The precision a run's model is evaluated and sampled in, as the trainer evaluates it: bf16 autocast on
    CUDA, the weights' own dtype elsewhere."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()


def eval_run(run_dir: str | Path, checkpoint: str | Path | None = None, data: str | None = None,
             batch_size: int | None = None, seq_len: int | None = None, max_batches: int = 0,
             device: str = "auto") -> dict[str, Any]:
    """Validation loss/perplexity of a checkpoint, causal and top-k routing."""
    for name, value, least in (("--batch_size", batch_size, 1), ("--seq_len", seq_len, 1),
                               ("--eval_batches", max_batches, 0)):
        if value is not None and value < least:
            raise ValueError(f"{name} {value} must be >= {least}" + (" (0: the whole split)" if least == 0 else ""))
    run = load_run(run_dir, checkpoint, device)
    train_cfg = run.config.get("train", {})
    data_dir = data or run.config.get("data", {}).get("path") or train_cfg.get("data")
    if not data_dir:
        raise ValueError(f"run {run_dir} does not record its data directory: pass --data")
    if data is None and not Path(data_dir).expanduser().exists():
        raise ValueError(f"run {run_dir} was trained on {data_dir}, which is gone; pass --data DIR prepared with the "
                         "run's tokenizer")
    info = open_data(data_dir)
    if info.vocab_size > run.model.config.vocab_size or not tokenized_alike(run.config.get("data", {}), info):
        raise ValueError(f"{data_dir} was not tokenized like the data run {run_dir} was trained on, so its losses "
                         "would mean nothing: evaluate on data prepared with the run's tokenizer "
                         "(`hydra-lm prepare --tokenizer RUN_DIR/tokenizer.json ...`)")
    from ..data import read_meta
    from ..data.loader import same_data

    trained_on = run.checkpoint.state.get("loader") or {}
    if data is None and not same_data(trained_on, read_meta(info.path)):
        raise ValueError(f"{data_dir} was prepared again since run {run_dir} trained on it (other inputs or options), "
                         "so its validation split may hold documents the run trained on: pass --data DIR to "
                         "evaluate on it anyway")
    limit = run.model.config.max_seq_len
    if seq_len is not None and seq_len > limit:
        raise ValueError(f"--seq_len {seq_len} exceeds the model's max_seq_len={limit}: pass --seq_len <= {limit}")
    bs = batch_size or train_cfg.get("batch_size") or 8
    sl = seq_len or train_cfg.get("seq_len") or 256
    t0 = time.perf_counter()

    use_doc_ids = train_cfg.get("document_masking", True)
    result = evaluate(run.model, ValSet(info, bs, sl), run.device, max_batches, lambda: _autocast(run.device),
                      use_doc_ids)
    return {"checkpoint": str(run.checkpoint.path), "step": run.checkpoint.step, **result,
            "eval_s": round(time.perf_counter() - t0, 2)}


def generate_text(run_dir: str | Path, prompt: str | list[str], max_new_tokens: int = 100, temperature: float = 0.8,
                  top_k: int | None = 50, top_p: float | None = None, seed: int = 0,
                  checkpoint: str | Path | None = None, device: str = "auto",
                  compile_step: bool | None = None) -> str | list[str]:
    """Prompt in, prompt + continuation out, decoded with the run's tokenizer (causal routing), in bf16 autocast
    on CUDA as evaluation runs; ``compile_step`` as ``HydraModel.generate`` (default: compiled units on CUDA).
    A list of prompts (any lengths) is sampled as one batch and gives a list of texts; each continues for at most
    ``max_new_tokens`` and at most what the model's context leaves after the longest prompt. Prompt i samples
    with a generator of its own seeded ``seed + i``, so it gets in the batch what it gets alone with that seed (up
    to rounding, which the batch's shapes can change). Seeds are taken modulo 2**64, as a generator takes a negative
    one (-1 seeds it as 2**64 - 1 does): any integer serves, and ``seed + i`` past 2**64 - 1 wraps to 0."""
    prompts = [prompt] if isinstance(prompt, str) else list(prompt)
    if not prompts:
        raise ValueError("no prompt given")
    check_sampling(temperature, top_k, top_p)  # before the checkpoint loads, which can take a while
    run = load_run(run_dir, checkpoint, device)
    tok = run_tokenizer(run)
    # Prepared documents start with the separator, so each prompt is framed as the start of one.
    ids = [[tok.eos_id] + tok.encode(text) for text in prompts]
    vocab, context = run.model.config.vocab_size, run.model.config.max_seq_len
    top = max(max(row) for row in ids)
    if top >= vocab:
        raise ValueError(f"the tokenizer produced id {top} outside the model's vocabulary ({vocab})")
    longest = max(len(row) for row in ids)
    room = context - longest + 1  # the last new token is sampled, never fed back: it takes no position
    if room <= 0:
        which = f"prompt {max(range(len(ids)), key=lambda i: len(ids[i])) + 1}" if len(ids) > 1 else "the prompt"
        raise ValueError(f"{which} ({longest} tokens) is longer than the model's context ({context}): shorten it")
    if max_new_tokens > room:
        print(f"note: max_new_tokens {max_new_tokens} -> {room}: the model's context is {context} tokens"
              + (" and the longest prompt takes the rest" if len(ids) > 1 else ""), file=sys.stderr)
        max_new_tokens = room
    # Modulo 2**64: manual_seed refuses an int past 64 bits ("Overflow when unpacking long long").
    generators = [torch.Generator(device=run.device).manual_seed((seed + i) % 2**64) for i in range(len(ids))]
    with _autocast(run.device):  # the precision its validation losses were measured in
        out = run.model.generate(ids, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                 eos_token_id=tok.eos_id, generator=generators, compile_step=compile_step)
    texts = []
    for text, row, full in zip(prompts, ids, out):
        new = full[len(row):].tolist()
        if tok.eos_id in new:
            new = new[:new.index(tok.eos_id)]
        texts.append(text + continuation(tok, row[1:], new))
    return texts[0] if isinstance(prompt, str) else texts


def continuation(tok, prompt_ids: list[int], new_ids: list[int]) -> str:
    """The text ``new_ids`` add after ``prompt_ids``. Decoded alone they can lose what joins them to the prompt (a
    SentencePiece-style Metaspace decoder drops the first token's leading space), so the prompt's text is taken
    off the whole decode where that starts with it."""
    prompt, whole = tok.decode(prompt_ids), tok.decode(prompt_ids + new_ids)
    return whole[len(prompt):] if whole.startswith(prompt) else tok.decode(new_ids)
