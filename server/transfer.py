"""Weight-transfer sessions and engine sleep, inside the worker: what codraft keeps consistent
when an RL trainer drives vLLM's own weight-sync protocol (docs/rl.md).

vLLM's protocol moves weights straight into the live model: `start_weight_update` (the target)
or `start_draft_weight_update` (the draft), any number of `update_weights`, then
`finish_weight_update`. codraft's control API (`codraft.server.weight_sync`) brackets each
session with two RPCs of the worker extension, which call into this module:

- `begin(kind)` before vLLM's start: opens the session (409 while one is open). For a draft
  session it snapshots the serving draft's kernel state (`snapshot_live`), the state a failed
  or refused transfer goes back to and a later rollback installs.
- `end(ok, version)` after vLLM's finish (or after any failure, with ok False): a policy
  session makes `version` the serving policy, exactly as `POST /v1/policy` does (taps, stats
  and response headers carry it from then on). A failed policy session leaves the target's
  weights part old, part new, with nothing to restore them from: the engine is then marked
  `policy_broken` and the server refuses generation (503) until a policy loads or a transfer
  completes. A draft session rebuilds what vLLM's DFlash
  model derives outside its layers (fused context K/V, RoPE reference) from the weights that
  arrived, since vLLM's reload rebuilt them from placeholders; checks every drafter tensor
  (loaded, finite) and makes them draft `version`, the snapshot its previous draft
  (rollback goes back to it); weights that fail the check, or a session that failed, put the
  snapshot back. While a session is open, codraft's own draft swaps and policy loads answer 409.

Sleep: vLLM's level 2 discards every weight, the draft's included, and a trainer then pushes
the policy only; level 1 offloads them. `sleep(level)` keeps a host copy of everything the
draft reads (codraft.server.sleep_copy: the drafter's tensors and its proposer's, not only its
layers) and `wake(tags)` writes each back when its memory pool is awake again, so the draft,
its version and its acceptance survive a sleep of either level.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

import torch

from codraft.server.draft_kernels import (
    DERIVED_ATTRS,
    KernelState,
    derived_tensors,
    install,
    rebuild_derived,
    rebuild_from_layers,
    snapshot_live,
)
from codraft.server.hooks import drafter_model, proposer, target_model
from codraft.server.sleep_copy import SleepCopy, draft_tensors, module_tensors, pool_tags
from codraft.server.weights import (
    DraftSlot,
    PolicySlot,
    SwapError,
    check_version_step,
    policy_broken_message,
    utc_now,
)

# `e` below is the worker extension's CodraftEngine (not imported: it imports this module)
CodraftEngine = Any

log = logging.getLogger(__name__)

KINDS = ("policy", "draft")
TRANSFERRED = "transfer"  # the `path` of a draft or policy that arrived by weight transfer


@dataclass
class Session:
    kind: str  # "policy" or "draft"
    started_at: str
    snapshot: KernelState | None = None  # the serving draft before a draft session
    # the weights that reached the drafter's load_weights that the DFlash model derives its
    # fused tensors from (checkpoint names, `rebuild_derived`); None when it derives nothing
    arrived: dict[str, torch.Tensor] | None = None


DERIVED_FROM = ("self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.k_norm.weight")


def _record_arrivals(model: torch.nn.Module, arrived: dict[str, torch.Tensor]) -> None:
    """Tee the weights vLLM's session hands the drafter's `load_weights` that the fused tensors
    come from into `arrived` (an instance attribute over the method; `_stop_recording` removes
    it)."""
    load = model.load_weights

    def load_weights(weights: Any, *args: Any, **kwargs: Any) -> Any:
        def tee() -> Any:
            for name, t in weights:
                if name.endswith(DERIVED_FROM):
                    arrived[name.removeprefix("model.")] = t.detach().clone()
                yield name, t

        return load(tee(), *args, **kwargs)

    model.load_weights = load_weights  # type: ignore[method-assign]


def _stop_recording(model: torch.nn.Module) -> None:
    model.__dict__.pop("load_weights", None)


def _restore(model: torch.nn.Module, snapshot: KernelState) -> None:
    """Put the draft from before the session back: its layers, then what the DFlash model
    derives outside them (its RoPE reference from the layers; the fused tensors from the
    snapshot, since the CPU build's layers keep their weights repacked elsewhere)."""
    install(snapshot)
    try:
        rebuild_from_layers(model)
    except RuntimeError as err:
        log.error("codraft: rebuilding the draft's fused tensors after a rollback: %s", err)
    install(snapshot)


class Transfers:
    """The open weight-transfer session (one at most) and the draft kept across a sleep."""

    def __init__(self) -> None:
        self.session: Session | None = None
        self.asleep: SleepCopy | None = None  # what the draft reads, on the host, while asleep
        self.completed = {"policy": 0, "draft": 0}
        self.failed = {"policy": 0, "draft": 0}

    def info(self) -> dict[str, Any]:
        s = self.session
        return {
            "open": None if s is None else {"kind": s.kind, "started_at": s.started_at},
            "asleep": self.asleep is not None,
            "completed": dict(self.completed),
            "failed": dict(self.failed),
        }

    def refuse_while_open(self, what: str) -> None:
        """409 for codraft's own swaps and policy loads while a session is open."""
        if self.session is not None:
            raise SwapError(
                409,
                f"{what} refused: a {self.session.kind} weight transfer has been open since "
                f"{self.session.started_at}; finish it (POST /finish_weight_update) first",
            )

    # ------------------------------------------------------------------ sessions
    def begin(self, e: CodraftEngine, kind: Any) -> dict[str, Any]:
        if kind not in KINDS:
            raise SwapError(422, f"kind must be one of {KINDS}, got {kind!r}")
        self.refuse_while_open(f"a {kind} weight transfer")
        session = Session(kind, utc_now())
        if kind == "draft":
            model = drafter_model(e.runner)
            session.snapshot = snapshot_live(model, target_model(e.runner))
            if derived_tensors(model):
                session.arrived = {}
                _record_arrivals(model, session.arrived)
        self.session = session
        log.info("codraft: %s weight transfer begins", kind)
        return {"ok": True, "transfer": self.info()}

    def end(self, e: CodraftEngine, ok: Any, version: Any = None) -> dict[str, Any]:
        s = self.session
        if s is None:
            raise SwapError(409, "no weight transfer is open: start one first")
        if not isinstance(ok, bool):
            raise SwapError(422, f"ok must be true or false, got {ok!r}")
        if ok:  # a version that is not newer leaves the session open: finish again with another
            version = self.next_version(e, s.kind, version)
        self.session = None
        if s.kind == "draft":
            _stop_recording(drafter_model(e.runner))
        if not ok:
            self.failed[s.kind] += 1
            if s.snapshot is not None:
                _restore(drafter_model(e.runner), s.snapshot)
                log.warning("codraft: draft weight transfer failed; draft v%d restored",
                            e.current.version)  # fmt: skip
                return {"ok": True, "restored": True, "draft": e.info()["draft"]}
            # vLLM's session writes the live weights as they arrive: some may be new, some old
            e.policy_broken = policy_broken_message(
                f"a policy weight transfer failed after it began writing the target's weights "
                f"(v{e.policy.version} served before it)",
                transfer=True,
            )
            log.error("codraft: %s", e.policy_broken)
            return {"ok": True, "restored": False, "policy": e.policy.info()}
        if s.kind == "policy":
            e.policy = PolicySlot(version, TRANSFERRED, utc_now())
            e.policy_broken = None  # every weight arrived: generation is served again
            e.acceptance.restart(e.current.version)  # every draft is measured anew
            self.completed["policy"] += 1
            log.info("codraft: policy v%d arrived by weight transfer", version)
            return {"ok": True, "policy": e.policy.info(), "reset_prefix_cache": True}
        assert s.snapshot is not None
        model = drafter_model(e.runner)
        bad = unusable_tensors(model, attributes=False)  # the layers first: the rebuild reads them
        if not bad:
            try:
                if s.arrived is not None:  # from what arrived (the CPU build repacks the layers')
                    rebuild_derived(model, s.arrived)
            except RuntimeError as err:  # (StageError: the arrivals lack a layer's K/V)
                bad = [f"rebuilding the DFlash model's fused tensors failed ({err})"]
            bad = bad or unusable_tensors(model)
        if bad:
            _restore(model, s.snapshot)
            self.failed["draft"] += 1
            raise SwapError(
                422,
                f"the transferred draft is unusable: {', '.join(bad[:5])}"
                f"{', ...' if len(bad) > 5 else ''}; draft v{e.current.version} serves again",
            )
        live = snapshot_live(drafter_model(e.runner), target_model(e.runner))
        old = e.current
        new = DraftSlot(version, None, TRANSFERRED, utc_now(), old.config, {}, live)  # type: ignore[arg-type]
        e.swapper.adopt(new, replace(old, kernels=s.snapshot, weights={}))
        self.completed["draft"] += 1
        return e.swapped({"ok": True, "ready": True, "timing_ms": {}})

    def check(self, e: CodraftEngine, version: Any = None) -> dict[str, Any]:
        """The open session's kind and the version its finish will take (409 when none is
        open, or when `version` is not newer), asked before vLLM finishes."""
        if self.session is None:
            raise SwapError(409, "no weight transfer is open: start one first")
        kind = self.session.kind
        return {"ok": True, "kind": kind, "version": self.next_version(e, kind, version)}

    def next_version(self, e: CodraftEngine, kind: Any, version: Any = None) -> int:
        """`version` checked to be newer than the serving one (409), or the next one."""
        if kind not in KINDS:
            raise SwapError(422, f"kind must be one of {KINDS}, got {kind!r}")
        if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
            raise SwapError(422, f"version must be a non-negative integer or null, got {version!r}")
        if kind == "policy":
            floor, what = e.policy.version, "the serving policy's"
        else:
            floor, what = e.swapper.highest, "the highest draft version installed"
        if version is None:
            return floor + 1
        check_version_step(kind, version, floor)
        if version <= floor:
            raise SwapError(
                409, f"{kind} version {version} is not newer than {what} ({floor}): finish the "
                "transfer again with a newer version, or without one (the next is taken)",
            )  # fmt: skip
        return version

    # ------------------------------------------------------------------ sleep
    def sleep(self, e: CodraftEngine, level: Any) -> dict[str, Any]:
        if level not in (1, 2) or isinstance(level, bool):
            raise SwapError(422, f"level must be 1 or 2, got {level!r}")
        self.refuse_while_open("sleep")
        if self.asleep is None:  # a second sleep keeps the first copy (the weights may be gone)
            self.asleep = SleepCopy.take(draft_places(e.runner), pool_tags())
        kept = self.asleep
        log.info("codraft: draft v%d kept on the host for sleep level %d (%d tensors, %.1f MB)",
                 e.current.version, level, len(kept.saved), kept.nbytes() / 1e6)  # fmt: skip
        return {"ok": True, "asleep": True, "draft": e.info()["draft"]}

    def wake(self, e: CodraftEngine, tags: Any = None) -> dict[str, Any]:
        if tags is not None and not (
            isinstance(tags, list) and all(isinstance(t, str) for t in tags)
        ):
            raise SwapError(422, f"tags must be a list of strings or null, got {tags!r}")
        if self.asleep is not None:
            missed = self.asleep.restore(tags)
            if not self.asleep.saved:
                self.asleep = None
                log.info("codraft: draft v%d restored after wake-up%s", e.current.version,
                         f" ({len(missed)} tensors missed)" if missed else "")  # fmt: skip
        return {"ok": True, "asleep": self.asleep is not None, "draft": e.info()["draft"]}


def draft_places(runner: Any) -> dict[str, Any]:
    """Everything the serving draft reads that is not the target's (codraft.server.sleep_copy)."""
    return draft_tensors(proposer(runner), drafter_model(runner), target_model(runner))


def unusable_tensors(model: torch.nn.Module, attributes: bool = True) -> list[str]:
    """What a transfer left unusable in the drafter: parameters and buffers holding NaN or Inf
    or still the reload's placeholders (meta), and tensors its modules keep beside them (the
    DFlash model's fused weights and RoPE reference; `attributes`) on meta or, where derived,
    empty; each named with its state."""
    bad = []
    with torch.inference_mode():
        for name, place in module_tensors(model, attributes):
            t = place.get()
            if t is None:
                continue
            if t.is_meta:
                bad.append(f"{name} (not loaded)")
            elif place.kind == "attr":
                if place.key in DERIVED_ATTRS and not t.numel():
                    bad.append(f"{name} (empty)")
            elif t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
                bad.append(f"{name} (NaN or Inf)")
    return bad
