"""The online learner's ranks in step: rank 0 ingests, every rank trains.

Under torchrun, `codraft learn --server` runs one rank that owns everything that faces the
outside (the tap socket, the sample buffer, /metrics, evaluation, checkpoints, publishing) and
dp x cp ranks that train (rank 0 among them). Rank 0 says what happens next with a command
broadcast over the world:

* IDLE: nothing to train yet (or the buffer is empty); every rank waits and asks again. Rank 0
  sends one at least every `IDLE_EVERY_S`, so that no rank's wait reaches the process group's
  timeout while the server is quiet;
* START: build the trainer from rank 0's first draft (its vocabulary from the buffer): rank 0
  sends its tensors (`share_draft`), so that every rank starts from the same weights;
* RESUME: build the trainer from the newest checkpoint in --out, on every rank (the folder is
  shared, as the server's draft loads need anyway);
* STEP: rank 0 has drawn one batch per data-parallel replica; it keeps replica 0's and sends
  each other rank its replica's batch (`send_batches` / `recv_batch`; the CP ranks of a replica
  get the whole batch and take their zigzag shards of it). Gradients are then summed over
  dp x cp inside `Trainer.step` (codraft.learner.parallel.context), so every rank holds the same
  weights after every step;
* EVAL (pipelines only): a publish is due and the held-out requests came without features;
  the lead sends them to the last stages of replica 0, whose pipelines run the target over
  them (`PipelineLearner.features`), so that the lead can compare the candidate with the
  serving draft as one process does;
* STOP: leave the loop.

Why rank 0 ingests (rather than every rank binding a tap endpoint of its own, which the server's
round-robin would also feed): the stream a server sends is small next to what a rank can take
(748 MB/s at batch 64 at Llama-8B geometry, docs/benchmarks.md, while one PULL socket takes
several GB/s on a host), one buffer keeps one retention policy, one held-out set and one draft
vocabulary, and a fixed data order gives the single-process run's weights, which is how the
distributed learner is tested. The cost is rank 0 sending each step's batches to the other ranks
(`scripts/bench_online_feed.py` measures it against the step).

With pipeline parallelism (pp > 1) the lead is not rank 0 but the last stage of replica 0, the
rank that holds a draft: it commands, shares its first draft and sends the batches, and only the
last stages (the data ranks) receive batches; each passes its batch down its own pipeline.

Every transfer is tensors (an int64 header, then the batch's own tensors): no pickle between
ranks.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from codraft.draft.config import DraftConfig
from codraft.draft.dflash import DFlashDraft
from codraft.draft.dflash_config import DFlashConfig
from codraft.draft.model import Eagle3Draft
from codraft.learner.data.packing import PackedBatch
from codraft.learner.parallel.batch_broadcast import from_int_body, int_body, int_body_size
from codraft.learner.parallel.mesh import ParallelMesh

STOP, IDLE, START, RESUME, STEP, EVAL = 0, 1, 2, 3, 4, 5
IDLE_EVERY_S = 1.0
_FEATURES = ("taps", "last_hidden", "teacher_logits")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_HEADER = 3 + 3 * len(_FEATURES)  # tokens, docs, pad multiple; per feature: width, dtype, on


class BatchFeed:
    """Commands and batches from rank 0 to every rank of the learner (see module doc). With one
    rank every call is local and nothing is sent."""

    def __init__(self, mesh: ParallelMesh, device: torch.device, lead: int = 0) -> None:
        """`lead`: the rank that ingests and commands (0; under pipeline parallelism the last
        stage, which holds the draft)."""
        self.mesh, self.lead = mesh, lead
        # gloo moves CPU tensors, NCCL the rank's GPU tensors
        self.device = device if _backend() == "nccl" else torch.device("cpu")
        self.bytes_sent = 0  # rank 0: batch bytes sent to the other ranks

    @property
    def world(self) -> int:
        return self.mesh.dims.world_size

    def command(self, op: int) -> int:
        """The lead's `op` on every rank (what other ranks pass is ignored). Collective."""
        if self.world == 1:
            return op
        t = torch.tensor([op], dtype=torch.int64, device=self.device)
        dist.broadcast(t, src=self.lead)
        return int(t.item())

    # ------------------------------------------------------------------ batches
    def send_batches(self, batches: list[PackedBatch], to: list[int] | None = None) -> PackedBatch:
        """The lead: one batch per data-parallel replica, sent to the ranks `to` (default:
        every other rank), each its replica's; returns replica 0's (its own)."""
        if len(batches) != self.mesh.dp_size:
            raise ValueError(
                f"expected {self.mesh.dp_size} batches (one per replica), got {len(batches)}"
            )
        dims = self.mesh.dims
        for rank in to if to is not None else range(self.world):
            if rank == self.lead:
                continue
            _, replica, _ = dims.coords(rank)
            self.bytes_sent += self._send(batches[replica], rank)
        return batches[0]

    def recv_batch(self) -> PackedBatch:
        """A rank the lead sends to: its replica's batch of this step (on the CPU, as packed)."""
        header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
        dist.recv(header, src=self.lead)
        n, docs, pad, *feat = header.tolist()
        body = torch.empty(int_body_size(n, docs), dtype=torch.int64, device=self.device)
        dist.recv(body, src=self.lead)
        features = {}
        for i, name in enumerate(_FEATURES):
            width, code, on = feat[3 * i : 3 * i + 3]
            if on:
                t = torch.empty(n, width, dtype=_DTYPES[code], device=self.device)
                dist.recv(t, src=self.lead)
                features[name] = t.cpu()
        return from_int_body(body, n, docs, pad_multiple=pad, **features)

    def _send(self, b: PackedBatch, dst: int) -> int:
        header = [b.num_tokens, b.num_docs, b.pad_multiple]
        tensors = []
        for name in _FEATURES:
            t = getattr(b, name)
            if t is None:
                header += [0, 0, 0]
                continue
            if t.dtype not in _DTYPES:
                raise TypeError(f"{name} of dtype {t.dtype}: expected one of {_DTYPES}")
            header += [t.shape[-1], _DTYPES.index(t.dtype), 1]
            tensors.append(t.reshape(b.num_tokens, -1).contiguous().to(self.device))
        body = int_body(b).to(self.device)
        sent = 0
        for t in (torch.tensor(header, dtype=torch.int64, device=self.device), body, *tensors):
            dist.send(t, dst=dst)
            sent += t.numel() * t.element_size()
        return sent

    # ------------------------------------------------------------------ the first draft
    def share_draft(self, draft: Eagle3Draft | DFlashDraft | None) -> Eagle3Draft | DFlashDraft:
        """The lead passes its new draft, the others None; every rank gets the same weights and
        vocabulary maps (its kind and config as JSON bytes, then every tensor of its state).
        Collective."""
        if self.world == 1:
            assert draft is not None
            return draft
        src = self.mesh.rank == self.lead
        blob = (
            json.dumps({"kind": draft.config.kind, "config": draft.config.to_dict()}).encode()
            if src
            else b""
        )
        size = torch.tensor([len(blob)], dtype=torch.int64, device=self.device)
        dist.broadcast(size, src=self.lead)
        raw = (
            torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(self.device)
            if src
            else torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        )
        dist.broadcast(raw, src=self.lead)
        if not src:
            sent = json.loads(bytes(raw.cpu().tolist()).decode())
            if sent["kind"] == "dflash":
                draft = DFlashDraft(DFlashConfig(**sent["config"]))
            else:
                draft = Eagle3Draft(DraftConfig(**sent["config"]))
        state = draft.state_dict()
        for name in sorted(state):
            t = state[name].to(self.device).contiguous()
            dist.broadcast(t, src=self.lead)
            if not src:
                state[name].copy_(t.to(state[name].device))
        return draft


def _backend() -> str | None:
    return dist.get_backend() if dist.is_available() and dist.is_initialized() else None
