"""TapChannel: tap activations from the stages that make them to the stage that trains the draft,
beside the pipeline and never in its way.

Picture (receiver = the last stage, one ring per source; S = `slots`):

    source stage 0 --put #0,#1,...--> [slot 0][slot 1]...[slot S-1]  ring of stage 0 -> get
    source stage 1 --put #0,#1,...--> [slot 0][slot 1]...[slot S-1]  ring of stage 1 -> get
               <------------ credit #n (slot of put #n is free again) ----

Rules, each for a reason:

* Own process groups (`data_group` for puts, `credit_group` for credits), never the pipeline's.
  On NCCL every group (per peer pair) has its own communicator and CUDA stream, and the
  operations of one stream run in the order they were posted: a tap receive posted on the
  pipeline's group would hold up every activation transfer posted after it. Credits get a group
  of their own for the same reason: a credit sent behind a posted tap receive on one stream
  would wait for that receive, which waits for the credit.
* Matching by position: the n-th `put` of a source meets the n-th `get` of that source. The
  receiver posts the receive for put #n into slot n mod S in order; point-to-point messages
  between two ranks in one group are not overtaking on gloo and on NCCL, so no message tags and
  no any-source receives are needed (NCCL honours neither).
* Landing slots: receives are posted ahead (as soon as a slot is free and `expect` told the
  shape), so a tap lands while the receiver is still busy and `get` usually finds it there.
* Credit-based flow control: a source may have S puts not yet released by the receiver; put
  #n waits for the credit of put #n-S and for nothing else. A source blocks only when its ring is
  full.
* Deadlines: every wait is bounded by `timeout_s` (well below the collective watchdog) and the
  error names the stages, the slot, the put number and the microbatch.
* With `verify`, every put is preceded by a 4-integer header (magic, put number, microbatch,
  element count) that `get` checks, so a schedule drift is an error, not silently wrong taps.

The code is device-agnostic: CPU tensors go over gloo, CUDA tensors over NCCL p2p (on one host
NCCL uses CUDA IPC / NVLink by itself; across hosts the network), with the same calls. Ranks that
share a GPU (`ParallelConfig.share_gpu`, single-GPU smoke runs) use gloo groups, and every put,
header and credit of a CUDA tensor is staged through host memory
(`codraft.learner.parallel.host_staged`, through which all transfers here go; unchanged calls when
it is off).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from codraft.learner.parallel import host_staged
from codraft.learner.parallel.host_staged import Request
from codraft.learner.parallel.p2p_wait import PeerTimeout, check_below_watchdog, wait_work

MAGIC = 0x436F5461  # "CoTa": first word of every put header


class TapChannelError(RuntimeError):
    """TapChannel was used against its protocol (wrong role, drift between the two sides)."""


class TapChannelTimeout(PeerTimeout):
    """A put or a get waited longer than `timeout_s`; the message names stage, slot, microbatch."""


@dataclass
class TapChannelConfig:
    slots: int = 2  # landing slots per source on the receiver (the ring size S)
    timeout_s: float = 60.0  # the longest a put may wait for a free slot, a get for its data
    verify: bool = True  # send and check a small header with every put

    def __post_init__(self) -> None:
        if self.slots < 1:
            raise ValueError(f"TapChannel needs at least one landing slot, got slots={self.slots}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")


@dataclass
class TapChannelStats:
    puts: int = 0
    gets: int = 0
    put_blocked_s: float = 0.0  # time sources spent waiting for a free slot (ring full)
    get_wait_s: float = 0.0  # time the receiver spent waiting for data that had not landed


@dataclass
class _Slot:
    buffer: torch.Tensor | None = None  # flat, grown to the largest put it has received
    header: torch.Tensor | None = None
    work: Request | None = None
    header_work: Request | None = None
    seq: int = -1  # put number posted into this slot
    microbatch: int = -1
    shape: tuple[int, ...] = ()

    def view(self) -> torch.Tensor:
        return self.buffer[: _numel(self.shape)].view(self.shape)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@dataclass
class _Ring:
    """The receiver's landing slots for one source. `tail` is the slot the next receive is
    posted into, `head` the slot the next get reads; put numbers count posted/consumed puts."""

    slots: list[_Slot]
    expected: deque = field(default_factory=deque)  # (shape, microbatch) not posted yet
    order: deque = field(default_factory=deque)  # (shape, microbatch) of every put not taken
    head: int = 0
    tail: int = 0
    posted: int = 0
    consumed: int = 0
    taken: bool = False  # a get is out and not yet released


@dataclass
class _Outgoing:
    tensor: torch.Tensor
    header: torch.Tensor | None
    works: list[Request | None]
    credit: torch.Tensor
    credit_work: Request | None
    microbatch: int


class TapChannel:
    """Puts from `sources` to `receiver` (global ranks), matched by position per source.

    Receiver: `expect(src, shape, microbatch)` for every put it will take (in put order), then
    `get(src, microbatch)` -> a view of the landing slot, valid until `release(src)`.
    Source: `put(tensor, microbatch)`; `close()` at the end waits until the receiver took all.
    Ranks in neither role may hold a TapChannel (every rank builds the same one) but not use it.
    """

    def __init__(
        self,
        data_group: dist.ProcessGroup,
        credit_group: dist.ProcessGroup,
        sources: Sequence[int],
        receiver: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        config: TapChannelConfig | None = None,
        names: Mapping[int, str] | None = None,
        rank: int | None = None,
    ) -> None:
        self.cfg = config or TapChannelConfig()
        self.data_group, self.credit_group = data_group, credit_group
        self.sources = list(sources)
        self.receiver = receiver
        if receiver in self.sources:
            raise ValueError(f"rank {receiver} cannot be a source and the receiver of TapChannel")
        if len(set(self.sources)) != len(self.sources):
            raise ValueError(f"TapChannel sources repeat: {self.sources}")
        check_below_watchdog(self.cfg.timeout_s, data_group, "TapChannelConfig.timeout_s")
        self.dtype, self.device = dtype, torch.device(device)
        self.names = dict(names or {})
        self.rank = dist.get_rank() if rank is None else rank
        self.stats = TapChannelStats()
        S = self.cfg.slots
        # receiver: one ring of landing slots per source (buffers are allocated when posted)
        self._rings = {s: _Ring([_Slot() for _ in range(S)]) for s in self.sources}
        self._credits_out: deque[tuple[Request | None, torch.Tensor]] = deque()
        self._sent = 0
        self._outgoing: dict[int, _Outgoing] = {}  # put number -> what is still in flight

    # ------------------------------------------------------------------ naming
    def _name(self, rank: int) -> str:
        return self.names.get(rank, f"rank {rank}")

    @property
    def is_receiver(self) -> bool:
        return self.rank == self.receiver

    @property
    def is_source(self) -> bool:
        return self.rank in self.sources

    def _need(self, role: str) -> None:
        ok = self.is_receiver if role == "receiver" else self.is_source
        if not ok:
            who = "the receiver" if role == "receiver" else "a source"
            raise TapChannelError(
                f"{self._name(self.rank)} is not {who} of this TapChannel (sources "
                f"{[self._name(s) for s in self.sources]}, receiver {self._name(self.receiver)})"
            )

    def _ring(self, src: int) -> _Ring:
        self._need("receiver")
        if src not in self._rings:
            raise TapChannelError(
                f"{self._name(src)} is not a source of this TapChannel; sources are "
                f"{[self._name(s) for s in self.sources]}"
            )
        return self._rings[src]

    # ------------------------------------------------------------------ receiver
    def expect(self, src: int, shape: Sequence[int], microbatch: int) -> None:
        """Announce the next put of `src` (its shape); its receive is posted as soon as a
        landing slot is free, so the data lands before `get` asks for it."""
        ring = self._ring(src)
        entry = (tuple(int(d) for d in shape), int(microbatch))
        ring.expected.append(entry)
        ring.order.append(entry)
        self._post_ready(src, ring)

    def _post_ready(self, src: int, ring: _Ring) -> None:
        while ring.expected and ring.posted - ring.consumed < self.cfg.slots:
            shape, microbatch = ring.expected.popleft()
            slot = ring.slots[ring.tail]
            numel = _numel(shape)
            if slot.buffer is None or slot.buffer.numel() < numel:
                slot.buffer = torch.empty(numel, dtype=self.dtype, device=self.device)
            slot.seq, slot.microbatch, slot.shape = ring.posted, microbatch, shape
            if self.cfg.verify:
                if slot.header is None:
                    slot.header = torch.empty(4, dtype=torch.int64, device=self.device)
                slot.header_work = host_staged.irecv(slot.header, src, self.data_group)
            slot.work = host_staged.irecv(slot.view(), src, self.data_group)
            ring.tail = (ring.tail + 1) % self.cfg.slots
            ring.posted += 1

    def get(self, src: int, microbatch: int) -> torch.Tensor:
        """The next put of `src` (put number = gets of `src` so far), waiting for it to land.
        The view stays valid until `release(src)`."""
        ring = self._ring(src)
        n = ring.consumed
        if ring.taken:
            raise TapChannelError(
                f"get of put #{n} of {self._name(src)} while put #{n} is still out: "
                f"release({src}) the previous get first"
            )
        if ring.posted == n:
            raise TapChannelError(
                f"get of put #{n} (microbatch {microbatch}) of {self._name(src)}, but no put was "
                "announced: call expect(src, shape, microbatch) for every put first"
            )
        shape, announced = ring.order[0]
        if announced != microbatch:
            raise TapChannelError(
                f"get for microbatch {microbatch} from {self._name(src)}, but put #{n} was "
                f"announced for microbatch {announced}: gets must follow the order of expect"
            )
        k = ring.head
        slot = ring.slots[k]

        def waiting(what: str) -> str:
            return (
                f"TapChannel: {self._name(self.rank)} waited for {what} of put #{n} "
                f"(microbatch {microbatch}) from source {self._name(src)} in landing slot {k} "
                f"of {self.cfg.slots}; the source has not sent it (stopped, slow, or running a "
                f"different schedule). Raise TapChannelConfig.timeout_s "
                f"(now {self.cfg.timeout_s:g} s) only if the source is known to be that slow"
            )

        t0 = time.monotonic()
        deadline = t0 + self.cfg.timeout_s
        if self.cfg.verify:
            self._wait(slot.header_work, deadline, lambda: waiting("the header"))
            self._check_header(src, n, k, slot, shape, microbatch)
        self._wait(slot.work, deadline, lambda: waiting("the data"))
        self.stats.get_wait_s += time.monotonic() - t0
        self.stats.gets += 1
        ring.taken = True
        return slot.buffer[: _numel(shape)].view(shape)

    def _check_header(
        self, src: int, n: int, k: int, slot: _Slot, shape: tuple[int, ...], microbatch: int
    ) -> None:
        magic, seq, mb, numel = slot.header.tolist()
        want = _numel(shape)
        if (magic, seq, mb, numel) != (MAGIC, n, microbatch, want):
            raise TapChannelError(
                f"TapChannel: {self._name(self.rank)} expected put #{n} of {self._name(src)} for "
                f"microbatch {microbatch} with {want} elements in landing slot {k}, got put "
                f"#{seq} for microbatch {mb} with {numel} elements (magic {magic:#x}, expected "
                f"{MAGIC:#x}): the two sides disagree on the schedule"
            )

    def release(self, src: int) -> None:
        """Hand the landing slot of the last get of `src` back: the next receive is posted into
        it and the source gets a credit."""
        ring = self._ring(src)
        if not ring.taken:
            raise TapChannelError(f"release({src}) without a get of {self._name(src)} out")
        n = ring.consumed
        ring.taken = False
        ring.order.popleft()
        ring.head = (ring.head + 1) % self.cfg.slots
        ring.consumed += 1
        self._post_ready(src, ring)
        credit = torch.full((1,), n, dtype=torch.int64, device=self.device)
        self._credits_out.append((host_staged.isend(credit, src, self.credit_group), credit))
        self._reap_credits(keep=self.cfg.slots * len(self.sources))

    def _reap_credits(self, keep: int) -> None:
        while len(self._credits_out) > keep:
            work, _ = self._credits_out.popleft()
            self._wait(
                work,
                time.monotonic() + self.cfg.timeout_s,
                lambda: (
                    f"TapChannel: {self._name(self.rank)} could not hand a credit back to a "
                    "source (the source stopped taking credits)"
                ),
            )

    def pending(self, src: int) -> int:
        """Puts of `src` announced or posted and not yet taken."""
        ring = self._ring(src)
        return len(ring.order)

    # ------------------------------------------------------------------ source
    def put(self, tensor: torch.Tensor, microbatch: int) -> None:
        """Send the next put (number = puts so far) to the receiver; waits only while all S
        landing slots hold puts the receiver has not released."""
        self._need("source")
        if tensor.dtype != self.dtype or tensor.device.type != self.device.type:
            raise TapChannelError(
                f"TapChannel carries {self.dtype} on {self.device.type}, got {tensor.dtype} on "
                f"{tensor.device.type}"
            )
        n = self._sent
        S = self.cfg.slots
        if n >= S:
            t0 = time.monotonic()
            self._settle(n - S)
            self.stats.put_blocked_s += time.monotonic() - t0
        tensor = tensor.contiguous()
        works: list[Request | None] = []
        header = None
        if self.cfg.verify:
            header = torch.tensor(
                [MAGIC, n, microbatch, tensor.numel()], dtype=torch.int64, device=self.device
            )
            works.append(host_staged.isend(header, self.receiver, self.data_group))
        works.append(host_staged.isend(tensor, self.receiver, self.data_group))
        credit = torch.empty(1, dtype=torch.int64, device=self.device)
        credit_work = host_staged.irecv(credit, self.receiver, self.credit_group)
        self._outgoing[n] = _Outgoing(tensor, header, works, credit, credit_work, microbatch)
        self._sent += 1
        self.stats.puts += 1

    def _settle(self, n: int) -> None:
        """Wait for the credit of put #n (the receiver released its slot), then retire it."""
        out = self._outgoing.pop(n)
        S = self.cfg.slots
        deadline = time.monotonic() + self.cfg.timeout_s

        def waiting() -> str:
            return (
                f"TapChannel: source {self._name(self.rank)} waited for landing slot {n % S} of "
                f"{S} on {self._name(self.receiver)} to send put #{n + S}; the receiver has "
                f"not released put #{n} (microbatch {out.microbatch}) from it (stopped, slow, "
                f"or running a different schedule). TapChannelConfig.timeout_s is "
                f"{self.cfg.timeout_s:g} s"
            )

        self._wait(out.credit_work, deadline, waiting)
        got = int(out.credit.item())
        if got != n:
            raise TapChannelError(
                f"TapChannel: source {self._name(self.rank)} expected the credit of put #{n}, "
                f"got the credit of put #{got}: the two sides disagree on the schedule"
            )
        for w in out.works:  # landed before the credit was sent: returns at once
            self._wait(w, deadline, waiting)

    def in_flight(self) -> int:
        """Puts of this source not yet released by the receiver (as far as known here)."""
        return len(self._outgoing)

    # ------------------------------------------------------------------ both
    def close(self) -> None:
        """Source: wait until the receiver released every put. Receiver: check that every
        announced put was taken and hand the last credits over."""
        if self.is_source:
            for n in sorted(self._outgoing):
                self._settle(n)
        if self.is_receiver:
            left = {self._name(s): self.pending(s) for s in self.sources if self.pending(s)}
            self._reap_credits(keep=0)
            if left:
                raise TapChannelError(f"TapChannel closed with puts not taken: {left}")

    def _wait(self, work: Request | None, deadline: float, describe) -> None:
        try:
            wait_work(work, self.device, max(deadline - time.monotonic(), 1e-3), describe)
        except PeerTimeout as e:
            raise TapChannelTimeout(str(e)) from None
