"""The ``hydra-lm`` command line: one sub-command per job, each implemented in its own module."""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys

import torch

from .config import ARCHS
from .train.distributed import launched_world_size
from .train.options import OPTIMIZERS


def _cmd_info(args: argparse.Namespace) -> int:
    from .diagnostics.info import print_info

    memory = []
    if args.memory:  # estimated first: a bad --batch_size fails before any of the report is printed
        from .train.memory_estimate import describe_memory

        memory = describe_memory(args.model_size, args.batch_size, args.seq_len, args.optimizer, args.arch,
                                 args.vocab_size, args.device)
    print_info(args.model_size, seq_len=args.seq_len, arch=args.arch, vocab_size=args.vocab_size)
    if memory:
        print("\n".join(memory))
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from .diagnostics.bench import format_report, run_bench, write_json
    from .diagnostics.bench_options import bench_config

    cfg = bench_config(args, args.model_overrides)

    def on_row(partial: dict) -> None:  # a run killed later still leaves the rows it finished
        r = partial["rows"][-1]
        print(f"bench: {r['arch']} done: {r['tokens_per_s']:,.0f} tok/s, first step {r['first_step_s']:.1f} s"
              + (f" ({r['parallel_compile']})" if r.get("parallel_compile") else ""), file=sys.stderr, flush=True)
        if cfg.json:
            write_json(partial, cfg.json)

    print(format_report(run_bench(cfg, on_row)))
    return 0


def _cmd_prepare(args: argparse.Namespace) -> int:
    from .data.cli import run_prepare

    return run_prepare(args)


def _cmd_train(args: argparse.Namespace) -> int:
    from torch.distributed.elastic.multiprocessing.errors import record

    from .train import setup_run, train
    from .train.distributed import shutdown
    from .train.flags import cli_values, load_config_file

    @record  # under torchrun: an unexpected error's traceback is reported per rank
    def run() -> int:
        try:
            file_values = load_config_file(args.config) if args.config else {}
            return train(setup_run(cli_values(args, args.model_overrides), file_values))
        finally:
            shutdown()

    return run()


def _cmd_compare(args: argparse.Namespace) -> int:
    from .diagnostics.compare import run_compare
    from .train.flags import cli_values, load_config_file

    file_values = load_config_file(args.config) if args.config else {}
    cli = cli_values(args, args.model_overrides)
    shared = {**file_values, **cli, "model": {**file_values.get("model", {}), **cli.get("model", {})}}
    return run_compare(shared.get("data"), shared.get("out"), args.budget, args.variants, args.custom_variants,
                       args.evals, shared, args.seeds, args.gpus, args.lrs, args.lr_extend)


def _cmd_scaling(args: argparse.Namespace) -> int:
    from .diagnostics.scaling import run_scaling

    return run_scaling(args.results, args.out, args.x, args.group, args.reference, args.predict, args.bootstrap,
                       args.seed, args.points)


def _cmd_eval(args: argparse.Namespace) -> int:
    from .infer import eval_run
    from .train.evaluate import routing_warnings
    from .train.metrics import finite_or_null

    result = eval_run(args.run, args.checkpoint, data=args.data, batch_size=args.batch_size, seq_len=args.seq_len,
                      max_batches=args.eval_batches, device=args.device)
    if args.json:
        print(json.dumps(finite_or_null(result)))  # strict JSON: a non-finite loss as null
    else:
        print(f"{result['checkpoint']} (step {result['step']}), {result['val_tokens']:,} validation tokens:")
        for mode, note in (("causal", "causal routing: what generation does"),
                           ("topk", "top-k routing: teacher-forced, not an autoregressive number")):
            print(f"  {mode:<6} loss {result[f'val_loss_{mode}']:.4f}  perplexity {result[f'val_ppl_{mode}']:.2f}"
                  f"   ({note})")
        print(f"  gap    {result['val_gap']:+.4f} nats (causal minus top-k)")
        if "routing" in result:
            overall = result.get("val_agreement_decisions")
            decisions = "" if overall is None else f" ({100 * overall:.1f}% of all routing decisions)"
            agreement = ("no top-k/threshold agreement (every router off)" if result.get("val_agreement") is None
                         else f"{100 * result['val_agreement']:.1f}% top-k/threshold agreement, mean of the routers "
                         "switched on")
            print(f"  routing: {agreement}{decisions}; executed fraction per router, causal against its top-k target:")
            for name, r in result["routing"].items():
                agrees = "off (runs every candidate)" if r.get("agreement") is None else \
                    f"agreement {100 * r['agreement']:.1f}%"
                print(f"    {name:<16} {r['exec_causal']:.3f} / {r['target']:.3f}   {agrees}")
        for warning in routing_warnings(result):
            print(f"  warning: {warning}")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from .infer import generate_text

    if args.top_k < 0:  # before 0 becomes None (all tokens) below, and the sampler's own ">= 1" misleads
        raise ValueError(f"--top_k {args.top_k} must be 0 (all tokens) or more")
    texts = generate_text(args.run, args.prompt, args.max_new_tokens, args.temperature, args.top_k or None, args.top_p,
                          args.seed, args.checkpoint, args.device, args.compile_step)
    if len(texts) == 1:
        print(texts[0])
    else:
        for i, text in enumerate(texts):
            print(f"----- sample {i + 1} of {len(texts)} -----\n{text}")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from .infer import export_model

    path = export_model(args.run, args.out, args.checkpoint)
    print(f"wrote {path}: the full model in one safetensors file (use it with --checkpoint {path})")
    return 0


def _cmd_quickstart(args: argparse.Namespace) -> int:
    from .quickstart import quickstart

    return quickstart(args.out, args.max_steps, args.seed, args.prompt, args.max_new_tokens, args.device)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hydra-lm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="parameters, FLOPs, cache size and head layout of a preset")
    info.add_argument("--model_size", default="100M", help="preset name (debug, 50M, 100M, ...)")
    info.add_argument("--arch", default="hydra", choices=list(ARCHS))
    info.add_argument("--seq_len", type=int, default=1024, help="sequence length for the FLOP count")
    info.add_argument("--vocab_size", type=int, default=None, help="override the preset's vocabulary size")
    info.add_argument("--memory", action="store_true", help="also estimate peak training memory for "
                                                            "--batch_size x --seq_len, --optimizer and --device")
    info.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                      help="--memory: the trainer's defaults on this device (cuda: bf16 autocast and the fused "
                           "loss; cpu: fp32)")
    info.add_argument("--batch_size", type=int, default=8, help="sequences per micro-batch for --memory")
    info.add_argument("--optimizer", default="adamw", choices=list(OPTIMIZERS), help="optimizer for --memory")
    info.set_defaults(func=_cmd_info)

    from .diagnostics.bench_options import FIELDS as bench_fields
    from .train.flags import add_field_arguments

    bench = sub.add_parser("bench", help="time training steps (and inference) of a preset and its dense baseline; "
                                         "compiled, CUDA-graphed and with the fused loss as `train` runs by default")
    add_field_arguments(bench, bench_fields)
    bench.epilog = "Model config fields: --model.FIELD VALUE (e.g. --model.mod_capacity 0.5), applied to both archs."
    bench.set_defaults(func=_cmd_bench)

    from .data.cli import add_prepare_arguments
    from .train.flags import add_train_arguments

    prepare = sub.add_parser("prepare", help="corpus -> tokenizer + token shards (no input: the embedded default "
                                             "corpus, the Python standard library source)")
    add_prepare_arguments(prepare)
    prepare.set_defaults(func=_cmd_prepare)

    train = sub.add_parser("train", help="train a model (resumes automatically when RUN_DIR has checkpoints)")
    add_train_arguments(train)
    train.set_defaults(func=_cmd_train)

    from .diagnostics.variants import BUILTIN_VARIANTS, DEFAULT_VARIANTS

    compare = sub.add_parser("compare", conflict_handler="resolve",
                             help="train model variants on the same data for the same budget; report, plots")
    add_train_arguments(compare)  # shared by every variant
    compare.add_argument("--out", default=None, help="output directory: runs/NAME per variant, results.json, "
                                                     "report.md and the plots")
    compare.add_argument("--budget", required=True, help="per variant: tokens=N, flops=N (executed training "
                                                         "FLOPs), k/M/G/T/P suffixes; or seconds=N (training "
                                                         "time), s/m/h units (seconds=10m)")
    compare.add_argument("--variants", nargs="+", default=None, metavar="NAME",
                         help=f"built-in variants ({', '.join(BUILTIN_VARIANTS)}; default: "
                              f"{' '.join(DEFAULT_VARIANTS)} unless --variant is given)")
    compare.add_argument("--variant", dest="custom_variants", action="append", default=None,
                         metavar="NAME:field=value,...", help="a custom variant: HydraConfig fields on top of the "
                         "preset, the routing curriculum's settings (mod_enable_pct, mor_enable_pct, ...) and the "
                         "optimizer's (optimizer, lr, min_lr, adamw_lr, weight_decay), the precision's "
                         "(experimental_fp8, fp8_format, fp8_recipe, fp8_min_tokens), budget_scale (its share of "
                         "--budget, e.g. 0.7); repeatable; arch=dense allowed")
    compare.add_argument("--evals", type=int, default=None,
                         help="evaluations spread evenly over the budget (default 8; or --eval_every N steps, "
                              "0: the start and the end only)")
    compare.add_argument("--seeds", type=int, nargs="+", default=None, metavar="SEED",
                         help="train every variant once per seed (runs/NAME.seedS; instead of --seed) and report "
                              "each variant's mean and spread over them")
    compare.add_argument("--lrs", type=float, nargs="+", default=None, metavar="LR",
                         help="train every variant once per peak learning rate (runs/NAME.lrX; instead of --lr) "
                              "and report each one's best: a fair ranking takes every model at its best LR")
    compare.add_argument("--lr_extend", type=int, default=0, metavar="N",
                         help="with --lrs: up to N more rounds; after each, every variant whose best LR is the "
                              "smallest or largest of its grid trains once more one grid step beyond it")
    compare.add_argument("--gpus", type=int, default=1, metavar="N",
                         help="train N runs at a time, one per CUDA GPU of this host (each logs to "
                              "OUT/compare.gpuI.log); default 1: one after another")
    compare.set_defaults(func=_cmd_compare)

    scaling = sub.add_parser("scaling", help="fit L(C) = a*C^-b + c to compare results; predict and compare "
                                             "compute at equal loss")
    scaling.add_argument("--results", nargs="+", required=True, metavar="DIR", help="`hydra-lm compare` output "
                                                                                    "directories")
    scaling.add_argument("--out", default=None, help="where scaling.png and scaling.json go (default: the first "
                                                     "results directory)")
    scaling.add_argument("--x", default="flops", choices=["flops", "seconds"], help="compute axis: executed "
                                                                                      "training FLOPs or seconds")
    scaling.add_argument("--group", default="family", choices=["family", "variant"],
                         help="fit per family (hydra-like vs dense-like) or per variant name")
    scaling.add_argument("--points", default="frontier", choices=["frontier", "all"],
                         help="frontier: each variant's seeds averaged, then only the points no point at less or "
                              "equal compute beats (a family's best model at each compute); all: every run's points")
    scaling.add_argument("--reference", default="dense", help="the group other groups' compute is compared with")
    scaling.add_argument("--predict", type=float, default=None, metavar="C", help="predict the loss at this compute")
    scaling.add_argument("--bootstrap", type=int, default=200, help="resamples for the uncertainty")
    scaling.add_argument("--seed", type=int, default=0)
    scaling.set_defaults(func=_cmd_scaling)

    ev = sub.add_parser("eval", help="validation loss and perplexity of a run's checkpoint (causal and top-k)")
    ev.add_argument("--run", required=True, help="run directory")
    ev.add_argument("--checkpoint", default=None, help="checkpoint directory (or its name in the run's checkpoints/) "
                                                       "or exported .safetensors file (default: the run's newest good "
                                                       "checkpoint)")
    ev.add_argument("--data", default=None, help="data directory (default: the run's)")
    ev.add_argument("--batch_size", type=int, default=None)
    ev.add_argument("--seq_len", type=int, default=None)
    ev.add_argument("--eval_batches", type=int, default=0, help="at most this many batches (0: the whole split)")
    ev.add_argument("--device", default="auto")
    ev.add_argument("--json", action="store_true", help="print one JSON object")
    ev.set_defaults(func=_cmd_eval)

    exp = sub.add_parser("export", help="write a checkpoint (also a sharded multi-process one) as one safetensors "
                                        "file holding the full model and its config")
    exp.add_argument("--run", required=True, help="run directory")
    exp.add_argument("--checkpoint", default=None, help="checkpoint directory or its name in the run's "
                                                        "checkpoints/ (default: the newest good one)")
    exp.add_argument("--out", required=True, help="the .safetensors file to write")
    exp.set_defaults(func=_cmd_export)

    gen = sub.add_parser("generate", help="sample text from a run's checkpoint (causal routing, cached decoding)")
    gen.add_argument("--run", required=True, help="run directory")
    gen.add_argument("--prompt", required=True, action="append",
                     help="the text to continue; give it several times to sample several prompts as one batch "
                          "(the first samples with --seed, the next with --seed + 1, ..., each as it would alone "
                          "with that seed, up to bf16 rounding on a GPU; every prompt's new tokens are capped by the "
                          "context left after the longest prompt)")
    gen.add_argument("--max_new_tokens", type=int, default=100)
    gen.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    gen.add_argument("--top_k", type=int, default=50, help="sample among the k likeliest tokens; 0: all of them")
    gen.add_argument("--top_p", type=float, default=None,
                     help="sample among the likeliest tokens whose probabilities sum to p (nucleus), within --top_k's: "
                          "add --top_k 0 for the nucleus alone")
    gen.add_argument("--seed", type=int, default=0, help="any integer, taken modulo 2**64")
    gen.add_argument("--checkpoint", default=None, help="checkpoint directory (or its name in the run's "
                                                        "checkpoints/) or exported .safetensors file (default: the "
                                                        "run's newest good checkpoint)")
    gen.add_argument("--device", default="auto")
    # A few prompts a process, at most max_seq_len tokens each: the compiles (about 20 s for the 100M preset's decode
    # step and about 50 s for its prefill on an H200) cannot pay for themselves here, where the compiled step saves
    # well under a millisecond a token and the compiled prefill about 100 ms a prompt.
    gen.add_argument("--compile_step", default=False, action=argparse.BooleanOptionalAction,
                     help="torch.compile the decode step's routed units, and the prompt's prefill (faster per token "
                          "after about a minute of compiling at 100M; default off: a few prompts cannot repay it)")
    gen.set_defaults(func=_cmd_generate)

    quick = sub.add_parser("quickstart", help="prepare the default corpus, train the debug preset for a few "
                                              "minutes, report validation loss and print a sample")
    quick.add_argument("--out", default="hydra-quickstart", help="directory for data/ and run/")
    quick.add_argument("--max_steps", type=int, default=None)
    quick.add_argument("--seed", type=int, default=0)
    quick.add_argument("--prompt", default="def ")
    quick.add_argument("--max_new_tokens", type=int, default=80)
    quick.add_argument("--device", default="auto")
    quick.set_defaults(func=_cmd_quickstart)
    return parser


def _rank() -> str:
    return f"[rank {os.environ['RANK']}] " if launched_world_size() > 1 else ""


# What failed on a path the user named (an --out that is a file, a directory where a file goes, ...), and what to do.
_OS_ERRORS = {
    errno.ENOTDIR: ("create or open", "a part of that path is a file, not a directory: choose another path"),
    errno.EEXIST: ("create the directory", "a file of that name is in the way: choose another path or move the file"),
    errno.EISDIR: ("write", "a directory of that name is in the way: choose another path"),
    errno.EACCES: ("access", "choose a path you may write to, or change its permissions"),
    errno.EPERM: ("access", "choose a path you may write to, or change its permissions"),
    errno.EROFS: ("write", "the file system is read-only: choose another path"),
}


def _os_error_line(err: OSError) -> str | None:
    """One line for an OSError on a path; None for one without a path, whose traceback says more."""
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"no space left on the device writing {err.filename or 'a file'}: free some space and run again"
    if err.filename is None:
        return None
    action, hint = _OS_ERRORS.get(err.errno, ("access", "check the path"))
    # A rename names its temporary source first: the target is the path the user gave.
    return f"cannot {action}: {err.filename2 or err.filename}: {err.strerror or err}; {hint}"


def _oom_line(command: str, err: BaseException) -> str:
    """One line for a command that ran out of GPU memory: the start of torch's message (the failed allocation, the
    GPU's capacity and free memory; the allocator's details after it left out) and what to change."""
    from .train.memory_estimate import FIT_ADVICE

    estimate = "(`hydra-lm info --memory` estimates the peak)"
    hint = {"train": f"{FIT_ADVICE['train']} {estimate}; checkpoints already written are kept, and the same command "
                     "resumes from the last",
            "compare": f"{FIT_ADVICE['train']} {estimate}",
            "bench": f"{FIT_ADVICE['bench']} (with --inference: --decode_batches or --new_tokens)",
            "eval": "lower --batch_size or --seq_len",
            "generate": "give fewer --prompt at once or a smaller --max_new_tokens",
            }.get(command, "free the GPU's memory (another process may hold it) or use --device cpu")
    text = " ".join(str(err).split())
    for tail in (" Including non-PyTorch memory", " Of the allocated memory"):
        text = text.split(tail)[0]
    return f"out of GPU memory: {text.strip().rstrip('.')}; {hint}"


def main(argv: list[str] | None = None) -> int:
    from .train.flags import split_model_overrides

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        argv, model_overrides = split_model_overrides(argv)
    except ValueError as err:
        parser.error(str(err))
    args = parser.parse_args(argv)
    if model_overrides and args.command not in ("train", "bench", "compare"):
        parser.error(f"--model.* overrides apply to `train`, `bench` and `compare` only, not `{args.command}`")
    args.model_overrides = model_overrides
    # Fewer out-of-memory failures from fragmentation. Set for every command, so that `bench` and `compare` time
    # the allocator `train` runs with; read when CUDA's allocator starts, so before any command touches CUDA.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as err:  # bad user input: one clear line, no traceback
        print(f"hydra-lm {args.command}: {_rank()}error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        line = _os_error_line(err)
        if line is None:
            raise
        print(f"hydra-lm {args.command}: {_rank()}error: {line}", file=sys.stderr)
        return 2
    except torch.OutOfMemoryError as err:  # a step too large for the GPU: what to change, not a traceback
        print(f"hydra-lm {args.command}: {_rank()}error: {_oom_line(args.command, err)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"hydra-lm {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
