"""Where a cold compile's time goes, from the structured trace torch writes under ``TORCH_TRACE``.

    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TORCH_TRACE=/tmp/trace python -m hydra_lm bench --model_size 100M ...
    python benchmarks/compile_trace_summary.py /tmp/trace [--top 25]

Prints the compiled frames' totals (dynamo's ``compilation_metrics``, forward and backward) and the time inside each
of torch's named compile phases (its ``dynamo_timed`` events: tracing, AOT, inductor's lowering, scheduling and code
generation, waiting for Triton builds, autotuning benchmarks). Phases nest, so their times overlap; a phase's count
is how often it ran. No profiler runs, so the numbers are the compile's own; unlike cProfile, the trace is on disk
even when the process is killed part-way.
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

METRICS = ("entire_frame_compile_time_s", "backend_compile_time_s", "inductor_compile_time_s", "code_gen_time_s")


def records(path: Path):
    """(header, payload) of every entry: the header's JSON object, and the tab-indented JSON lines after it."""
    lines = path.read_text(errors="replace").split("\n")
    i = 0
    while i < len(lines):
        start = lines[i].find("{")
        j = i + 1
        while j < len(lines) and lines[j].startswith("\t"):
            j += 1
        if start >= 0:
            try:
                header = json.loads(lines[i][start:])
            except json.JSONDecodeError:
                header = None
            if header is not None:
                body = "\n".join(line[1:] for line in lines[i + 1:j])
                try:
                    yield header, json.loads(body) if body else None
                except json.JSONDecodeError:
                    yield header, None
        i = j


def summarize(trace_dir: Path, top: int) -> str:
    metrics = {"forward": collections.Counter(), "backward": collections.Counter()}
    frames = collections.Counter()
    spent = collections.Counter()
    runs = collections.Counter()
    for path in sorted(trace_dir.glob("*.log")):
        open_events: dict[tuple, list[float]] = collections.defaultdict(list)
        for header, payload in records(path):
            for key, side in (("compilation_metrics", "forward"), ("bwd_compilation_metrics", "backward")):
                if key in header:
                    frames[side] += 1
                    for name in METRICS:
                        metrics[side][name] += header[key].get(name) or 0.0
            if "chromium_event" in header and payload and payload.get("ph") in ("B", "E"):
                key = (payload["name"], payload.get("tid"), payload.get("pid"))
                if payload["ph"] == "B":
                    open_events[key].append(payload["ts"])
                elif open_events[key]:
                    spent[payload["name"]] += (payload["ts"] - open_events[key].pop()) / 1e6
                    runs[payload["name"]] += 1
    out = []
    for side in ("forward", "backward"):
        totals = ", ".join(f"{name.removesuffix('_time_s')} {metrics[side][name]:.1f} s" for name in METRICS
                           if metrics[side][name])
        out.append(f"{side}: {frames[side]} compiled frames; {totals or 'no times recorded'}")
    out.append(f"{'phase':<56} {'seconds':>9} {'count':>6}")
    for name, seconds in spent.most_common(top):
        out.append(f"{name[:56]:<56} {seconds:>9.1f} {runs[name]:>6}")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace_dir", type=Path, help="the TORCH_TRACE directory of one run")
    parser.add_argument("--top", type=int, default=25, help="phases to list, longest first")
    args = parser.parse_args()
    if not any(args.trace_dir.glob("*.log")):
        raise SystemExit(f"no trace logs (*.log) in {args.trace_dir}: run with TORCH_TRACE={args.trace_dir}")
    print(summarize(args.trace_dir, args.top))


if __name__ == "__main__":
    main()
