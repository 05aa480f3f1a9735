"""Decoding a batch as independent groups of rows, each group's step on a stream of its own (issue 14's batch-32
decode target; a study, not the generate path).

A decode step runs a routed unit when any row's token enters it, so at batch 32 the 100M preset runs about 15.6 of
its 32 units a step against 5-6 at batch 1 (``decode_units_bound.py``), and each unit is bound by its kernels' fixed
cost, not by its rows. Rows are independent at decode. Cut the batch into G groups, give each group its own
``DecodeStep`` over its rows of the caches, and launch each group's step on its own CUDA stream: each group runs only
the units its own rows enter, and the groups' small kernels can run side by side on the GPU. If they do, a step
costs about one group's chain of units, fewer than the whole batch's. The dense baseline runs every layer in every
group, so it gains only what concurrency gives.

Measured (H100, benchmarks/BENCHMARKS.md, eightieth session): they do not. At batch 32 the busiest of 8 groups ran
10.3 units a step against the whole batch's 16.6, but 4 and 8 groups decoded at 0.85x and 0.63x the single step's
tokens/s (dense 0.73x and 0.55x): the groups' graphs barely overlap. Not adopted in ``generate``.

    python benchmarks/decode_row_groups.py --batch 32 --groups 1,2,4,8 [--arch hydra,dense]
    python benchmarks/decode_row_groups.py --check        # CPU: every grouping's tokens equal one step's

Each group's step stops at its rows' hidden states and the norm and LM head run once over the whole batch, eagerly
after the groups join: in every group's graph the head would read its weights (77 MB at vocabulary 50,257, about
35 us at batch 1) once per group.

Timing as ``bench.decode_tokens_per_s``: a seeded prompt of ``--new_tokens`` tokens prefilled once for all rows,
then as many one-token steps, greedy, timed on their own (median of 3); on CUDA compiled and CUDA-graphed with the
decisions on the device, as ``generate`` runs them.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import time

import torch

import hydra_lm
from hydra_lm.model.decode_session import DecodeSession
from hydra_lm.model.decode_step import DecodeStep, decode_weights


def row_caches(caches: list, rows: slice) -> list:
    """The caches of ``rows``: views of every cache tensor's rows (its first dimension), written in place by a step."""
    def cut(cache):
        return dataclasses.replace(cache, **{f.name: getattr(cache, f.name)[rows] for f in dataclasses.fields(cache)
                                             if getattr(cache, f.name) is not None})
    return [[[cut(c) for c in depth] for depth in block] for block in caches]


def trunk_only(model):
    """``model`` with an identity for its final norm and LM head (every other module shared): a ``DecodeStep`` of it
    returns the new tokens' hidden states instead of their logits."""
    trunk = copy.copy(model)
    trunk._modules = dict(model._modules)  # a shallow copy would share the dict, and the model lose its head
    trunk.norm, trunk.lm_head = torch.nn.Identity(), torch.nn.Identity()
    return trunk


class GroupedDecode:
    """One ``DecodeStep`` per group of rows over ``session``'s caches, each launched on a stream of its own (CUDA),
    stopping at the hidden states; the norm and head run once over the joined batch."""

    def __init__(self, model, session: DecodeSession, groups: int, device: torch.device, graphed: bool, compiled: bool):
        batch = session.batch
        if batch % groups:
            raise SystemExit(f"--groups {groups} does not divide the batch {batch}")
        size = batch // groups
        self.rows = [slice(g * size, (g + 1) * size) for g in range(groups)]
        trunk = trunk_only(model)
        self.steps = [DecodeStep(trunk, row_caches(session.caches, rows), size, device, graphed, compiled)
                      for rows in self.rows]
        cuda = device.type == "cuda"
        self.streams = [torch.cuda.Stream(device) for _ in self.rows] if cuda and groups > 1 else None
        self.autocast = self.steps[0].autocast
        # As the steps would run it: the Linear weight cast once under autocast, no weight cache.
        enabled, dtype = torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type)
        lm_head = decode_weights(model.lm_head, dtype if enabled else None, False)
        self.head = lambda hidden: lm_head(model.norm(hidden))

    def __call__(self, tokens: torch.Tensor, position: int) -> torch.Tensor:
        if self.streams is None:
            out = torch.cat([step(tokens[rows], position) for step, rows in zip(self.steps, self.rows)])
        else:
            main = torch.cuda.current_stream()
            outs = []
            for step, rows, stream in zip(self.steps, self.rows, self.streams):
                stream.wait_stream(main)  # the tokens were chosen on the main stream
                with torch.cuda.stream(stream):
                    outs.append(step(tokens[rows], position))
            for stream in self.streams:
                main.wait_stream(stream)
            out = torch.cat(outs)
        with self.autocast():
            return self.head(out)

    @property
    def unit_calls(self) -> list[int]:
        return [step.unit_calls for step in self.steps]


def decode_rate(model, batch: int, groups: int, length: int, device: torch.device) -> tuple[float, float, float]:
    """(tokens/s, units a step summed over the groups, the most units a step of one group ran on average)."""
    cuda = device.type == "cuda"
    seeded = torch.Generator().manual_seed(batch)
    prompt = torch.randint(0, model.config.vocab_size, (batch, length), generator=seeded).to(device)
    session = DecodeSession(model, batch, 2 * length, device, model.decode_capturable() and cuda, cuda)
    step = GroupedDecode(model, session, groups, device, model.decode_capturable() and cuda, cuda)
    first = session.prefill(prompt).argmax(-1)
    for position in (length, length + 1):  # eager warm-up (compiles), then the capture
        step(first[:, None], position)

    def run() -> float:
        token = session.prefill(prompt).argmax(-1)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for position in range(length, 2 * length):
            token = step(token[:, None], position).argmax(-1)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    before = step.unit_calls
    seconds = statistics.median(run() for _ in range(3))
    units = [(after - b) / (3 * length) for after, b in zip(step.unit_calls, before)]
    return batch * length / seconds, sum(units), max(units)


def check(args) -> None:
    """Every grouping decodes the tokens ``generate``'s one step over the whole batch decodes (CPU, eager, fp32)."""
    torch.manual_seed(0)
    model = hydra_lm.create_model("debug", vocab_size=512, max_seq_len=128).eval()
    batch, length = 8, 12
    prompt = torch.randint(0, 512, (batch, length), generator=torch.Generator().manual_seed(1))
    runs = {}
    with torch.no_grad():
        for groups in (0, 1, 2, 4, 8):  # 0: the model's own DecodeStep, the head in its graph
            session = DecodeSession(model, batch, 2 * length, torch.device("cpu"), False, False)
            step = session.step if groups == 0 else GroupedDecode(model, session, groups, torch.device("cpu"), False,
                                                                  False)
            token, logits = session.prefill(prompt).argmax(-1), []
            for position in range(length, 2 * length):
                out = step(token[:, None], position)
                logits.append(out.clone())
                token = out.argmax(-1)
            runs[groups] = torch.stack(logits)
    for groups, logits in runs.items():
        torch.testing.assert_close(logits, runs[0], rtol=1e-5, atol=1e-5, msg=f"{groups} groups")
        print(f"{groups} groups: the same {length} steps' logits as one step over the batch")
    assert isinstance(model.lm_head, torch.nn.Linear), "the trunk-only copy took the model's head"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model_size", default="100M")
    p.add_argument("--arch", default="hydra,dense")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--groups", default="1,2,4,8")
    p.add_argument("--new_tokens", type=int, default=128)
    p.add_argument("--calibrate", type=int, default=30, help="HYDRA: training-mode forwards of 8 x 1024 first")
    p.add_argument("--check", action="store_true", help="CPU: the groupings decode the same tokens")
    args = p.parse_args()
    if args.check:
        return check(args)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for arch in args.arch.split(","):
        torch.manual_seed(0)
        model = hydra_lm.create_model(args.model_size, arch=arch, max_seq_len=1024).to(device)
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            if arch == "hydra" and args.calibrate:  # thresholds calibrated as training does (decode_rates.py)
                model.train()
                for _ in range(args.calibrate):
                    model(torch.randint(0, model.config.vocab_size, (8, 1024), device=device))
            model.eval()
            for groups in (int(g) for g in args.groups.split(",")):
                rate, units, most = decode_rate(model, args.batch, groups, args.new_tokens, device)
                print(f"{arch:6s} batch {args.batch} in {groups} groups: {rate:10,.0f} tokens/s, "
                      f"{units:5.2f} units a step in all, {most:5.2f} in the busiest group", flush=True)


if __name__ == "__main__":
    main()
