"""``hydra-lm quickstart``: prepare the embedded corpus, train the debug preset, evaluate, sample.

Sized for a laptop-class CPU: the whole job takes a few minutes on two cores. Running it again
on the same directory resumes (or, when finished, just re-reports and samples).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from .infer import generate_text
from .train.options import check_seed
from .train.run import pick_device, setup_run
from .train.trainer import train

# Measured on 2 idle CPU cores: ~25 s for the corpus and tokenizer, ~2 s per step, ~5 s per evaluation.
QUICKSTART = dict(model_size="debug", max_steps=150, batch_size=16, seq_len=128, lr=3e-3, warmup_steps=15,
                  schedule="cosine", log_every=10, eval_every=50, eval_batches=8, save_every=50)


def _eval_records(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if r.get("kind") == "eval":
            records.append(r)
    return records


def quickstart(out: str | Path = "hydra-quickstart", max_steps: int | None = None, seed: int = 0,
               prompt: str = "def ", max_new_tokens: int = 80, device: str = "auto") -> int:
    from .data import prepare_data

    if max_new_tokens < 0:  # before minutes of training, not after
        raise ValueError(f"--max_new_tokens {max_new_tokens} must be >= 0")
    if max_steps is not None and max_steps < 1:  # before the corpus is prepared, not after
        raise ValueError(f"--max_steps {max_steps} must be >= 1")
    check_seed(seed)
    pick_device(device)
    start = time.perf_counter()
    out = Path(out).expanduser()
    data_dir = prepare_data(None, out / "data")
    t_data = time.perf_counter() - start
    cli = {**QUICKSTART, "data": str(data_dir), "out": str(out / "run"), "seed": seed, "device": device}
    if max_steps is not None:
        cli["max_steps"] = max_steps
        cli["warmup_steps"] = min(QUICKSTART["warmup_steps"], max(1, max_steps // 10))
        cli["eval_every"] = max(1, max_steps // 4)
        cli["save_every"] = max(1, max_steps // 4)
    code = train(setup_run(cli))
    if code != 0:
        return code
    t_train = time.perf_counter() - start - t_data
    evals = _eval_records(out / "run")
    sample = generate_text(out / "run", prompt, max_new_tokens=max_new_tokens, temperature=0.8, top_k=40,
                           seed=seed, device=device, compile_step=False)  # one short sample: no compile
    print("\n" + "=" * 72)
    if evals:
        first, last = evals[0], evals[-1]
        print(f"validation loss (causal routing): {first['val_loss_causal']:.3f} at step {first['step']} -> "
              f"{last['val_loss_causal']:.3f} at step {last['step']} (top-k: {last['val_loss_topk']:.3f}, "
              f"perplexity {last['val_ppl_causal']:.1f})")
    print(f"sample (prompt {prompt!r}, temperature 0.8, top-k 40):\n{'-' * 72}\n{sample}\n{'-' * 72}")
    print(f"time: data {t_data:.0f}s, training {t_train:.0f}s, total {time.perf_counter() - start:.0f}s | "
          f"run directory {out / 'run'}")
    print(f"next: hydra-lm generate --run {out / 'run'} --prompt 'import '   |   hydra-lm eval --run {out / 'run'}")
    return 0
