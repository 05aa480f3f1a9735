"""--seq_len_schedule: train on shorter sequences first, longer ones later.

``"512:0,1024:0.3,2048:0.7"`` trains with 512-token rows from the start, 1024 from 30% of the run
and 2048 from 70%. The tokens per step stay constant (``--batch_size x --seq_len``), so the LR
schedule and throughput numbers keep their meaning: a stage of length L uses
``batch_size x seq_len / L`` rows. Every length must divide that product and be at most
``--seq_len`` (which defaults to the longest), and ``topk_groups`` divide its rows. Validation always runs at
``--seq_len``.

At a switch the loader for the new length takes over at the same fraction of the epoch (its rows
are cut and shuffled for its own length, so the rest of that epoch is a fresh shuffle rather than
exactly the unseen tokens). A compiled model recompiles once per length; stages are capped so
that torch.compile's cache holds every shape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_STAGES = 4


@dataclass(frozen=True)
class SeqLenSchedule:
    stages: tuple[tuple[int, float], ...]  # (length, start fraction), starts increasing from 0

    @classmethod
    def parse(cls, text: str) -> "SeqLenSchedule":
        stages = []
        for part in text.split(","):
            try:
                length, start = part.split(":")
                stages.append((int(length), float(start)))
            except ValueError:
                raise ValueError(f"seq_len_schedule={text!r}: write LENGTH:START_FRACTION pairs separated by commas, "
                                 "e.g. 512:0,1024:0.3,2048:0.7") from None
        starts = [s for _, s in stages]
        if not stages or not all(math.isfinite(s) for s in starts) or starts[0] != 0 or \
                any(b <= a for a, b in zip(starts, starts[1:])) or starts[-1] >= 1:
            raise ValueError(f"seq_len_schedule={text!r}: the first stage must start at 0 and the starts must increase "
                             "and stay below 1")
        if any(length < 1 for length, _ in stages):
            raise ValueError(f"seq_len_schedule={text!r}: lengths must be >= 1")
        if len(stages) > MAX_STAGES:
            raise ValueError(f"seq_len_schedule={text!r}: at most {MAX_STAGES} stages (each length is a "
                             "compiled shape)")
        return cls(tuple(stages))

    @property
    def longest(self) -> int:
        return max(length for length, _ in self.stages)

    def check(self, batch_size: int, seq_len: int, topk_groups: int = 1) -> None:
        """A ValueError where micro-batches of ``batch_size`` x ``seq_len`` tokens cannot run every stage. A top-k
        over the batch pools a stage's rows in ``topk_groups`` equal groups (HydraConfig.topk_groups)."""
        tokens = batch_size * seq_len
        for length, start in self.stages:
            if length > seq_len or tokens % length:
                raise ValueError(f"seq_len_schedule length {length} must be at most --seq_len {seq_len} and divide "
                                 f"the tokens per micro-batch (batch_size x seq_len = {tokens}): change the length or "
                                 "--batch_size")
            if (tokens // length) % topk_groups:
                raise ValueError(f"seq_len_schedule stage {length}:{start:g} runs micro-batches of {tokens // length} "
                                 f"rows (batch_size x seq_len / {length}), which model topk_groups={topk_groups} does "
                                 "not split into equal groups: change that stage's length, --batch_size or "
                                 "--model.topk_groups")

    def stage_at(self, clock: int, max_steps: int) -> int:
        """Index of the stage for the step with 0-based index ``clock``."""
        return max(i for i, (_, start) in enumerate(self.stages) if clock >= round(start * max_steps))

    def stage_of_length(self, length: int, near: int) -> int:
        """The stage a checkpoint's loader of ``length``-token rows was in: of the stages of that length (a schedule
        may come back to one), the latest at or before stage ``near``, where the run's next step falls."""
        matching = [i for i, (stage_len, _) in enumerate(self.stages) if stage_len == length]
        if matching:
            return max((i for i in matching if i <= near), default=matching[0])
        raise ValueError(f"the checkpoint's loader uses seq_len {length}, which --seq_len_schedule does not list: "
                         "resume with the schedule the run started with")

    def shape(self, stage: int, batch_size: int, seq_len: int) -> tuple[int, int]:
        """(rows, length) of a stage's micro-batches."""
        length = self.stages[stage][0]
        return batch_size * seq_len // length, length


def carry_over(state: dict, rows_per_step: int, length: int) -> dict:
    """A loader state for ``length``-token rows at the same point of the epoch as ``state``."""
    position = state["position"] * state["seq_len"] // length
    return {**state, "seq_len": length, "batch_size": rows_per_step,
            "position": position - position % rows_per_step}
