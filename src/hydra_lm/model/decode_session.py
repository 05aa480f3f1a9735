"""What ``HydraModel.generate`` keeps from one call to the next: the caches, the one-token step (with its
captured CUDA graphs) and, where the step is graphed (compiled or not), the prompt's prefill captured as a CUDA graph
per prompt-length bucket.

Built afresh for every call, a call paid its step's construction (the Linear weights cast once), an eager first
step and a capture before its second token, and a prefill launched kernel by kernel from the host: on an H200
about 94 ms a call for the 100M preset at batch 1 and 32 against 46 ms for 128 new tokens at batch 1
(benchmarks/BENCHMARKS.md, forty-sixth session). A session is built once per (batch, cache length, device,
settings) and kept while the model's weights, buffers, routing curriculum and config stay as they were
(``fingerprint``); anything else builds a new one, as does every call of a model whose weights are inference tensors.
A model keeps its ``SESSIONS_KEPT`` most recent sessions (``HydraModel.release_decode_state`` frees them).

Only a graphed or compiled step is worth keeping: an eager one (the CPU's default) has no graph to
reuse and its cache is exactly as long as its call needs (prompt + new tokens, no power-of-two bucket), so calls of
other lengths would each keep full-size caches alive after returning (4 x 128 MiB for the 100M preset at 8 x 1,000
positions). Its construction costs about 1 ms against a call's hundreds (the 100M preset on the CPU; under bf16
autocast, casting the Linear weights, about 35 ms), so it is built for each call and dropped after it.

The prefill graph: a prompt of T tokens is padded to its bucket (the next power of two, at least
``MIN_PREFILL_BUCKET``, at most the cache) with the padded entries marked invalid, which prefills exactly as the
prompt alone would (``HydraModel.forward_cached(valid=)``), and the bucket's graph replays the zeroing of the
caches and the whole prefill. Launched, the compiled prefill is bound by the host launching about 1,500
kernels (20-50 ms for the 100M preset at 1 x 128; eager, about 5,000 and 115 ms); replayed it takes 3.6-3.9 ms
(forty-fifth and forty-sixth sessions). Where the step is not compiled the prefill's eager kernels are captured
the same way (the eager prefill skips its host-synced cut while a stream captures). A bucket's first prompt is
launched, padded (a one-off call pays no warm-up and capture); its second captures the graph. A graph keeps its
intermediate memory reserved, so prompts of more than ``GRAPHED_PREFILL_TOKENS`` tokens (batch x bucket), whose
prefill is less host-bound, are always launched.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import OrderedDict

import torch

from .cuda_graphs import capture
from .decode_step import DecodeStep

SESSIONS_KEPT = 4
MIN_PREFILL_BUCKET = 16
GRAPHED_PREFILL_TOKENS = 8192


def cache_tensors(caches: list) -> list[torch.Tensor]:
    """Every tensor of ``HydraModel.init_cache``'s caches: zeroed in place, they are a fresh cache whose
    addresses the captured graphs still read."""
    return [t for block in caches for depth in block for cache in depth
            for t in (getattr(cache, f.name) for f in dataclasses.fields(cache)) if t is not None]


def fingerprint(model) -> tuple:
    """What a session's step and graphs were built from: every parameter's and buffer's storage and version
    (an optimizer step, ``load_state_dict`` or ``.to()`` changes one), the blocks' routing curriculum and the
    config. A write through ``.data`` changes neither storage nor version: after one, call
    ``HydraModel.release_decode_state()`` (the step's cast weight copies would otherwise be stale). An inference
    tensor (created or loaded under ``torch.inference_mode()``) keeps no version and may have been written in place
    unseen: a model with one matches no earlier fingerprint, so each call builds its session afresh."""
    tensors = tuple((t.data_ptr(), object() if t.is_inference() else t._version)
                    for t in itertools.chain(model.parameters(), model.buffers()))
    curriculum = tuple((b.mod_active, b.mor_active, b.mor_ramp) for b in model.blocks)
    return tensors, curriculum, repr(model.config)


def _pad(ids: torch.Tensor, padded: torch.Tensor, valid: torch.Tensor,
         lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``ids`` [B, T] written into ``padded`` [B, bucket] (the rest zero), ``valid`` marking each row's prompt: its
    first ``lengths`` [B] entries (default: all T)."""
    t = ids.shape[1]
    padded[:, :t].copy_(ids)
    padded[:, t:].zero_()
    if lengths is None:
        valid[:, :t].fill_(True)
        valid[:, t:].fill_(False)
    else:
        valid.copy_(_prompt_mask(lengths, valid.shape[1], valid.device))
    return padded, valid


def _prompt_mask(lengths: torch.Tensor, width: int, device: torch.device) -> torch.Tensor:
    """[B, width] bool: each row's first ``lengths[i]`` entries, its prompt."""
    return torch.arange(width, device=device) < lengths.to(device)[:, None]


class DecodeSession:
    """Caches of ``length`` positions for ``batch`` rows, the ``DecodeStep`` over them (``graphed``, ``compiled``,
    ``device_decisions`` as there), and ``prefill(prompt)``: the caches zeroed, the prompt run into them, its last
    logits returned (graph-replayed per bucket from a bucket's second prompt on where ``graphed``, and the prompt is
    short enough)."""

    def __init__(self, model, batch: int, length: int, device: torch.device, graphed: bool, compiled: bool,
                 device_decisions: bool | None = None):
        self.model, self.batch, self.length, self.compiled = model, batch, length, compiled
        self.caches = model.init_cache(batch, length, device)
        self._tensors = cache_tensors(self.caches)
        self.step = DecodeStep(model, self.caches, batch, device, graphed, compiled, device_decisions)
        self.fingerprint = fingerprint(model)
        self._graph_prefill = graphed
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self._seen: set[int] = set()  # buckets prefilled once, launched: the next prompt of one captures its graph
        self._pool = None  # one memory pool for every bucket's graph: they never run at once
        self._logits: torch.Tensor | None = None  # what every bucket's graph writes its logits into

    def bucket(self, t: int) -> int | None:
        """The padded length a prompt of ``t`` tokens replays at; None: launched as it is."""
        if not self._graph_prefill:
            return None
        bucket = min(self.length, max(MIN_PREFILL_BUCKET, 1 << (t - 1).bit_length()))
        return bucket if self.batch * bucket <= GRAPHED_PREFILL_TOKENS else None

    def prefill(self, ids: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """``ids`` [batch, T] from position 0 -> each row's last prompt position's logits [batch, V] (a graph's
        output buffer, overwritten by the next prefill of this session). ``lengths`` [batch] (prompts of several
        lengths, each row's first ``lengths[i]`` entries, the rest padding): every row prefills as its prompt alone
        would."""
        bucket = self.bucket(ids.shape[1])
        if bucket is None:
            return self._run(ids, None if lengths is None else _prompt_mask(lengths, ids.shape[1], ids.device))
        if bucket not in self._graphs:
            if bucket not in self._seen:  # a bucket's first prompt is launched: a one-off call pays no capture
                self._seen.add(bucket)
                padded, valid = _pad(ids, ids.new_empty(self.batch, bucket),
                                     torch.empty(self.batch, bucket, dtype=torch.bool, device=ids.device), lengths)
                return self._run(padded, valid)
            self._graphs[bucket] = self._capture(bucket)
        graph, padded, valid = self._graphs[bucket]
        _pad(ids, padded, valid, lengths)
        graph.replay()
        return self._logits

    def _run(self, ids: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        for t in self._tensors:
            t.zero_()
        # The step's autocast (no weight cache) for every prefill, launched or captured: one set of compiled graphs
        # (Dynamo guards on the autocast cache flag).
        with self.step.autocast():
            return self.model.forward_cached(ids, 0, self.caches, compiled=self.compiled, valid=valid)

    def _run_padded(self, padded: torch.Tensor, valid: torch.Tensor) -> None:
        logits = self._run(padded, valid)
        if self._logits is None:
            self._logits = torch.empty_like(logits)
        self._logits.copy_(logits)

    def _capture(self, bucket: int):
        device = self.caches[0][0][0].k.device
        padded = torch.zeros(self.batch, bucket, dtype=torch.long, device=device)
        valid = torch.ones(self.batch, bucket, dtype=torch.bool, device=device)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # compiles (once per batch size) off the capture
            for _ in range(2):
                self._run_padded(padded, valid)
        torch.cuda.current_stream(device).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(device), capture(graph, pool=self._pool):
            self._run_padded(padded, valid)
        return graph, padded, valid


class DecodeSessions(OrderedDict):
    """A model's sessions, most recently used last. Copying or pickling the model copies none of them (they hold
    CUDA graphs and the caches of one device)."""

    def __deepcopy__(self, memo):
        return DecodeSessions()

    def __reduce__(self):
        return DecodeSessions, ()

    def get_or_build(self, model, batch: int, length: int, device: torch.device, graphed: bool,
                     compiled: bool) -> DecodeSession:
        if not (graphed or compiled):  # nothing to reuse: built for this call only, kept nowhere (docstring)
            return DecodeSession(model, batch, length, device, graphed, compiled)
        enabled = torch.is_autocast_enabled(device.type)
        # Inference mode too: caches made under it are inference tensors, which a call outside it cannot zero.
        key = (batch, length, str(device), graphed, compiled, enabled, torch.get_autocast_dtype(device.type)
               if enabled else None, torch.is_inference_mode_enabled())
        session = self.pop(key, None)
        if session is not None and session.fingerprint != fingerprint(model):
            session = None  # built from other weights: its cast copies and graphs are stale
        if session is None:
            while len(self) >= SESSIONS_KEPT:
                self.popitem(last=False)
            session = DecodeSession(model, batch, length, device, graphed, compiled)
        self[key] = session
        return session

    def drop(self, session: DecodeSession) -> None:
        for key in [k for k, v in self.items() if v is session]:
            del self[key]
