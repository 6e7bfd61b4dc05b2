"""codraft inside SGLang's scheduler process: capture, tap, acceptance, draft swap and rollback.

One `SGLangEngine` per scheduler process, made by the plugin (codraft.server.sglang.plugin)
when the scheduler is built, from the settings `codraft serve --engine sglang` puts in the
environment (`CODRAFT_SGLANG`: a JSON map of `EngineConfig`'s fields under "codraft", the
draft checkpoint SGLang was started with under "draft", codraft's control endpoint under
"control"). What it needs of SGLang 0.5.17, all in the scheduler's own thread:

* `on_batch(batch)` / `on_target_forward(forward_batch, hidden)` / `end_batch(result)`: the
  EAGLE worker's step and, inside it, the target's forward. The target's verify or extend
  output carries the tap layers and, appended by the plugin, the final hidden state (after the
  final norm: the tap's `last_hidden`); `split_final` takes the final state off before the
  draft reads the hidden states (in every forward, warm-ups included), and this gathers the
  rows of the captured requests on the engine's stream (codraft.server.row_copy): no wait, no
  host copy in the step.
* `on_result(batch, result)`: the scheduler's processing of that step, one step later with the
  overlap scheduler: SGLang's accepted lengths are on the host now, so each request's final
  rows are known (codraft.server.sglang.capture), acceptance is counted per draft version, and
  requests that finished are handed to the assembler with SGLang's own output tokens.
* `poll()`: codraft's control calls, answered between batches (codraft.server.sglang.rpc).

The tap messages, their assembly and chunking (in a tap process of their own by default,
`EngineConfig.tap_assembly`: codraft.server.tap_process), the acceptance bookkeeping and the
automatic rollback rule are the ones of codraft's vLLM engine. EAGLE-3 with a chain of
drafts (topk 1) or DFlash (a block of drafts: the verification's rows are the block, SGLang's
committed length of them final), on SGLang's v2 workers, and tensor parallel size 1 are
required.
"""

from __future__ import annotations

import atexit
import inspect
import itertools
import json
import logging
import os
import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from codraft.server.acceptance import Acceptance, AutoRollback, FinishedVersions
from codraft.server.capture import Assembler, CaptureStats, TapTarget
from codraft.server.engine_config import EngineConfig
from codraft.server.row_copy import RowCopier, StagedRows
from codraft.server.sglang.capture import SGLangCapture, Step
from codraft.server.sglang.draft_weights import DraftWeights
from codraft.server.sglang.rpc import RpcServer
from codraft.server.sleep_copy import SleepCopy, digest, draft_tensors
from codraft.server.tap_process import TapProcess, publish_from, where_assembled
from codraft.server.tap_switch import TapSwitch
from codraft.server.weights import (
    DraftSlot,
    PolicySlot,
    SwapError,
    check_load_args,
    check_newer,
    check_policy,
    check_version_step,
    open_draft,
    policy_broken_message,
    read_initial_draft,
    target_at,
    utc_now,
)
from codraft.tap.message import DTYPES

log = logging.getLogger(__name__)

ENV = "CODRAFT_SGLANG"
# SGLang's speculative workers codraft's engine runs in, and the draft kind of each (SGLang's
# EAGLE worker v2 also drives the non-overlap scheduler)
WORKERS = {"EAGLEWorkerV2": "eagle3", "DFlashWorkerV2": "dflash"}


@dataclass
class Settings:
    """What the serving process hands the scheduler processes (through `ENV`)."""

    draft: str  # the codraft checkpoint SGLang serves at start (codraft's tap convention)
    control: str  # codraft's control endpoint (ipc://)
    codraft: EngineConfig

    def to_env(self) -> str:
        from dataclasses import asdict

        return json.dumps({"draft": self.draft, "control": self.control,
                           "codraft": asdict(self.codraft)})  # fmt: skip

    @classmethod
    def from_env(cls, environ: Any = os.environ) -> Settings | None:
        raw = environ.get(ENV)
        if not raw:
            return None
        d = json.loads(raw)
        return cls(d["draft"], d["control"], EngineConfig.from_dict(d.get("codraft")))


@dataclass
class _Pending:
    """A step's capture, between its forward and the scheduler's processing of its result."""

    rids: list[str]
    counts: list[int]
    extend: bool
    staged: list[int]
    rows: StagedRows | None
    version: int  # the draft that proposed this step's drafts


def split_final(runner: Any, output: Any) -> torch.Tensor | None:
    """The target's forward `output` carries the final hidden state after the tap layers (the
    plugin appends it): give the draft the tap layers alone, as SGLang made them, and return
    the whole [rows, (taps + 1) * H] (None when this forward captured no layers)."""
    lo = getattr(output, "logits_output", None)
    hs = getattr(lo, "hidden_states", None)
    taps = getattr(getattr(runner.model, "model", None), "layers_to_capture", None)
    if hs is None or not taps or hs.dim() != 2:
        return None
    h = int(runner.model_config.hf_config.hidden_size)
    if hs.shape[-1] != (len(taps) + 1) * h:
        return None
    lo.hidden_states = hs[:, : len(taps) * h].contiguous()
    return hs


class SGLangEngine(AutoRollback):
    """codraft's state in one SGLang scheduler process (module doc)."""

    def __init__(self, scheduler: Any, settings: Settings) -> None:
        self.scheduler = scheduler
        self.cfg = settings.codraft
        worker = scheduler.draft_worker
        args = scheduler.server_args
        kind = self._check(worker, args)
        self.target_runner = worker.target_worker.model_runner
        # DFlash keeps its draft model on the worker, EAGLE-3 in its draft worker's runner
        draft_model = (
            worker.draft_model if kind == "dflash" else worker.draft_worker.draft_runner.model
        )
        hf = self.target_runner.model_config.hf_config
        self.hidden = int(hf.hidden_size)
        initial = read_initial_draft(settings.draft)
        if initial.config.kind != kind:
            raise SwapError(503, f"SGLang runs {type(worker).__name__} ({kind}), the draft "
                                 f"{settings.draft} is a {initial.config.kind} draft")  # fmt: skip
        self.taps = tuple(initial.config.tap_layers)
        captured = list(getattr(self.target_runner.model.model, "layers_to_capture", []))
        if captured != list(self.taps):  # SGLang's layer i+1 is codraft's tap i+1 (docs)
            raise SwapError(
                503,
                f"SGLang captures the target's layers {captured}, the draft reads taps "
                f"{list(self.taps)}: start SGLang with the draft's SGLang config "
                "(DraftConfig.to_hf_dict(engine='sglang'))",
            )
        self.weights = DraftWeights(
            draft_model, self.target_runner.model, initial.weights.get("d2t")
        )
        self.current = replace(initial, weights={})
        self.previous: DraftSlot | None = None
        self.previous_params: dict[str, torch.Tensor] | None = None
        self.highest = self.current.version
        self.staged: dict | None = None  # a draft read and checked ahead of its swap
        self.staged_slot: DraftSlot | None = None
        self.ticket = 0
        self.sleep_copy: SleepCopy | None = None  # the draft, while SGLang's weights are released
        self.acceptance = Acceptance(self.cfg.rollback_window, self.cfg.rollback_min_requests)
        self.rollback_history: list[dict] = []
        self.pending_rollback: str | None = None
        self.swaps = self.rollbacks = self.auto_rollbacks = 0
        self.hook_errors = 0
        # requests being served -> how many of their output tokens the capture has been given
        self.running: dict[str, int] = {}
        self.versions_by_request = FinishedVersions(self.cfg.request_versions_max)
        self.tap = TapSwitch(self.cfg, flush=lambda: self.assembler.flush())
        runner = self.target_runner
        wire = DTYPES[self.cfg.tap_dtype] if self.cfg.tap_dtype else runner.dtype
        self.stats_ = CaptureStats()
        self.serving = target_at(args.model_path, hf.to_dict)
        self.policy = PolicySlot(0, self.serving["path"], utc_now())
        # set when a policy load failed and SGLang could not put the old weights back: the
        # serving side refuses generation until a policy loads again (as vLLM's engine does)
        self.policy_broken: str | None = None
        self.target = TapTarget(
            tap_layers=self.taps,
            hidden_size=self.hidden,
            fingerprint=self.serving["fingerprint"],
            dtype=wire,
            max_model_len=int(getattr(runner.model_config, "context_len", 1 << 30)),
        )
        # in a process of its own by default, as in codraft's vLLM engine: the scheduler's
        # loop is host-bound at a small target's batches and shares its interpreter lock with
        # every thread of its process (server/tap_process.py); the rows go through the pipe
        if self.cfg.tap_device_ring:
            log.warning("codraft: tap_device_ring is vLLM's; SGLang's rows go through the pipe")
        make = TapProcess if self.cfg.tap_assembly == "process" else Assembler
        self.assembler = make(
            self.target, self.tap.emit, lambda: self.current.version, self.cfg.tap_max_tokens,
            self.stats_,
        )  # fmt: skip
        publish_from(self.assembler, self.tap)
        self.capture = SGLangCapture(
            self.assembler, want=self.tap.want, policy_version=lambda: self.policy.version
        )
        device = torch.device(runner.device, runner.gpu_id) if runner.device == "cuda" else "cpu"
        self.copier = RowCopier(device, wire, self.cfg.tap_device_mb << 20)
        self._batch: Any = None
        self._pending: _Pending | None = None
        self.steps = 0
        self.tap.apply()
        self.rpc = RpcServer(settings.control, self.handle)
        self.closed = False
        atexit.register(self.close)  # what was captured reaches the learner at a clean exit
        log.info(
            "codraft: SGLang engine ready (draft v%d, taps %s, tap %s, control %s)",
            self.current.version, list(self.taps), "on" if self.tap.enabled else "off",
            settings.control,
        )  # fmt: skip

    @staticmethod
    def _check(worker: Any, args: Any) -> str:
        """The draft kind SGLang's speculative worker runs (refusing what codraft cannot)."""
        name = type(worker).__name__ if worker is not None else None
        kind = WORKERS.get(name)
        if kind is None:
            raise SwapError(
                503,
                f"codraft's SGLang engine needs EAGLE-3 or DFlash on SGLang's v2 workers "
                f"({', '.join(WORKERS)}), found {name}: start with speculative_algorithm "
                "'EAGLE3' or 'DFLASH'",
            )
        if kind == "eagle3" and int(getattr(args, "speculative_eagle_topk", 1) or 1) != 1:
            raise SwapError(503, "codraft captures chains of drafts: speculative_eagle_topk=1")
        if int(getattr(args, "tp_size", 1)) != 1 or int(getattr(args, "pp_size", 1)) != 1:
            raise SwapError(503, "codraft's SGLang engine runs with tp_size=1 and pp_size=1")
        return kind

    # ------------------------------------------------------------------ the step
    def on_batch(self, batch: Any) -> None:
        """The speculative worker's step begins (its target forward follows)."""
        self._batch = batch
        self._pending = None

    def on_target_forward(self, forward_batch: Any, hidden: torch.Tensor) -> None:
        """The target's forward returned `hidden` ([rows, (taps + 1) * H]: the tap layers and
        the final hidden state; `split_final` already gave the draft its part): gather the
        captured requests' rows."""
        batch = self._batch
        if batch is None:
            return  # a forward outside the speculative worker's step (warm-up)
        try:
            self._pending = self._stage(batch, forward_batch, hidden, len(self.taps) * self.hidden)
        except Exception:
            self.hook_errors += 1
            log.exception("codraft: capture of a step failed (the step itself is unaffected)")

    def _stage(self, batch: Any, fb: Any, hs: torch.Tensor, tap_width: int) -> _Pending:
        reqs = list(batch.reqs)
        rids = [r.rid for r in reqs]
        for r in reqs:
            if r.rid not in self.running and not r.finished():
                self.running[r.rid] = 0
                self.capture.begin(r.rid, list(r.origin_input_ids))
        extend, counts = self._row_counts(batch, fb)
        rows = int(hs.shape[0])
        # a CUDA graph's output may hold padding rows after the batch's
        if len(counts) != len(rids) or sum(counts) > rows:
            raise ValueError(
                f"{rows} rows ({fb.forward_mode}, forward batch of {fb.batch_size}) for "
                f"{len(rids)} requests of {counts} rows"
            )
        staged = [i for i in self.capture.rows_wanted(rids) if counts[i]]
        offsets = [0, *itertools.accumulate(counts)]
        ranges = [(offsets[i], offsets[i + 1]) for i in staged]
        gathered = None
        if ranges:
            gathered = self.copier.copy(
                fb.input_ids, fb.positions, [hs[:, :tap_width]], hs[:, tap_width:], ranges
            )
        return _Pending(rids, counts, extend, staged, gathered, self.current.version)

    @staticmethod
    def _row_counts(batch: Any, fb: Any) -> tuple[bool, list[int]]:
        """(a prefill?, each request's rows) of the target forward `fb` in `batch`'s step. The
        forward batch's own mode tells: the worker's step starts as a decode and its
        verification runs as TARGET_VERIFY, which SGLang counts among the extend modes."""
        mode = fb.forward_mode
        if mode.is_target_verify():
            spec = fb.spec_info
            layout = getattr(spec, "ragged_verify_layout", None)
            if layout is not None:  # each request its own number of rows
                lens = layout.verify_lens_cpu
                if lens is None:
                    lens = layout.verify_lens.tolist()
                return False, [int(n) for n in lens]
            return False, [int(spec.draft_token_num)] * len(batch.reqs)
        if mode.is_extend():
            return True, [int(n) for n in batch.extend_lens]
        raise ValueError(f"a target forward in {mode} inside a speculative step")

    def end_batch(self, result: Any) -> None:
        """The worker's step returned `result`: the step's capture travels with it."""
        if self._pending is not None and result is not None:
            try:
                result._codraft_step = self._pending
            except AttributeError:  # a result type without a __dict__: the step is lost
                self.hook_errors += 1
        self._batch = self._pending = None
        self.steps += 1

    def on_result(self, batch: Any, result: Any) -> None:
        """The scheduler processed a step's result (accepted lengths on the host)."""
        pending = getattr(result, "_codraft_step", None)
        if pending is not None:
            result._codraft_step = None
            try:
                self._account(pending, result, {r.rid: r for r in batch.reqs})
            except Exception:  # those requests go out incomplete (their rows are missing)
                self.hook_errors += 1
                log.exception("codraft: processing a step's capture failed")
        for req in batch.reqs:
            if req.rid in self.running and req.finished():
                try:
                    self._finished(req)
                except Exception:
                    self.hook_errors += 1
                    log.exception("codraft: finishing request %s failed", req.rid)
        self._check_rollback()

    def _account(self, p: _Pending, result: Any, reqs: dict[str, Any]) -> None:
        if p.extend:
            final = list(p.counts)
        else:
            accept = result.accept_lens
            final = [int(a) for a in (accept.tolist() if accept is not None else [])]
            if len(final) != len(p.rids):
                raise ValueError(f"{len(final)} accepted lengths for {len(p.rids)} requests")
            drafts = tokens = accepted = 0
            for rid, k, a in zip(p.rids, p.counts, final, strict=True):
                if rid in self.running and k > 1:
                    drafts += 1
                    tokens += k - 1
                    accepted += a - 1
                    self.acceptance.observe(rid, p.version, k - 1, a - 1)
            self.acceptance.record(p.version, drafts, tokens, accepted)
        # the tokens the step added (SGLang appended them to each request's output ids): a
        # long request's chunks go out before it finishes and are checked against them
        new = []
        for rid in p.rids:
            seen, req = self.running.get(rid), reqs.get(rid)
            out = [] if seen is None or req is None else list(req.output_ids[seen:])
            if seen is not None:
                self.running[rid] = seen + len(out)
            new.append(out)
        self.capture.step(Step(p.rids, p.counts, final, new, p.rows, p.staged))

    def _finished(self, req: Any) -> None:
        rid = req.rid
        self.running.pop(rid, None)
        self.capture.finish(rid, list(req.output_ids))
        self.acceptance.close(rid)
        self.versions_by_request.note([rid], self.current.version)

    def poll(self) -> None:
        """Between batches: a pending automatic rollback, then codraft's control calls."""
        if self.pending_rollback is not None:
            reason, self.pending_rollback = self.pending_rollback, None
            if self.previous is not None:
                self.rollback(reason, auto=True)
        self.rpc.poll()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.assembler.flush()
        self.tap.close_publisher()
        self.assembler.close()
        self.rpc.close()

    # ------------------------------------------------------------------ SGLang's weight routes
    def draft_places(self) -> dict:
        """Everything the draft reads that is not the target's (codraft.server.sleep_copy)."""
        return draft_tensors(None, self.weights.draft, self.target_runner.model)

    def before_release(self, tags: list[str] | None) -> None:
        """SGLang's release_memory_occupation is about to run: SGLang keeps the target's
        non-parameter state for the resume and nothing of the draft's, so codraft keeps the
        draft (on the host) when the weights are among what is released (None: all)."""
        if not tags or "weights" in tags:
            self.sleep_copy = SleepCopy.take(self.draft_places())
            log.info("codraft: draft kept on the host (%d bytes) while SGLang's weights are out",
                     self.sleep_copy.nbytes())  # fmt: skip

    def after_resume(self, tags: list[str] | None) -> None:
        """SGLang resumed memory: the draft back where its weights are mapped again."""
        if self.sleep_copy is not None and (not tags or "weights" in tags):
            if self.sleep_copy.restore(["weights"]):  # what could not be put back is logged
                self.hook_errors += 1
            self.sleep_copy = None

    def policy_changed(self, source: str) -> None:
        """SGLang's own route `source` changed the target's weights (an RL trainer's push):
        a new policy version, so tap messages and responses tell the weights apart."""
        self.policy = PolicySlot(self.policy.version + 1, f"sglang:{source}", utc_now())
        self.policy_broken = None  # the whole target arrived
        self.acceptance.restart(self.current.version)  # every draft is measured anew
        log.info("codraft: policy v%d (target weights through SGLang's %s)",
                 self.policy.version, source)  # fmt: skip

    def draft_digest(self) -> dict:
        return {"ok": True, "version": self.current.version, "tensors": digest(self.draft_places())}

    # ------------------------------------------------------------------ control calls
    def handle(self, method: str, kwargs: dict) -> dict:
        fn = self.CALLS.get(method)
        if fn is None:
            return {"ok": False, "status": 501,
                    "error": f"{method} is not offered by codraft's SGLang engine; it offers "
                             f"{sorted(self.CALLS)}"}  # fmt: skip
        try:
            inspect.signature(fn).bind(self, **kwargs)
        except TypeError as e:  # unexpected or missing arguments
            return {"ok": False, "status": 422, "error": f"{method}: {e}"}
        try:
            reply = fn(self, **kwargs)
        except SwapError as e:
            reply = {"ok": False, "status": e.status, "error": str(e)}
        return {**reply, "policy_broken": self.policy_broken}  # see load_policy

    def info(self) -> dict:
        return {
            "ok": True,
            "draft": {
                **self.current.info(),
                "previous_version": self.previous.version if self.previous else None,
                "previous_path": self.previous.path if self.previous else None,
                "highest_version": self.highest,
                "rollbacks": list(self.rollback_history),
                # SGLang samples with the token map it loaded first (draft_weights.py): a new
                # draft must keep the serving draft's d2t, which a learner reads from this.
                "vocab_map_fixed": True,
            },
            "policy": self.policy.info(),
            "policy_broken": self.policy_broken,
            "tap": self.tap.info(),
            "engine": "sglang",
        }

    def _read(self, path: Any, version: Any, sha256: Any) -> tuple[DraftSlot, float]:
        """Read and check a checkpoint with the vLLM engine's checks and statuses (arguments,
        newer version, contract and target fingerprint, sha256) and the vocabulary map SGLang
        keeps: the new slot (its tensors on the host) and the milliseconds it took."""
        t0 = time.perf_counter()
        path, version, sha256 = check_load_args(path, version, sha256)
        if version is not None:
            check_newer(version, self.highest, self.current.version)
        opened = open_draft(path, version, sha256, self.current, self.serving["fingerprint"])
        try:
            opened.verify()
            check_newer(opened.slot.version, self.highest, self.current.version)
            self.weights.check_maps(opened.slot.weights)
        except BaseException:
            opened.checked.release()
            raise
        return opened.slot, 1e3 * (time.perf_counter() - t0)

    def prepare_draft(self, path: Any, version: Any = None, sha256: Any = None) -> dict:
        """Read and check now (between two batches: a draft is small), install at the swap."""
        slot, ms = self._read(path, version, sha256)
        self.ticket += 1
        self.staged = {
            "ticket": str(self.ticket), "path": path, "version": slot.version, "state": "ready",
            "status": None, "error": None, "sha256": slot.sha256,
            "files_changed": False, "timing_ms": {"read_check_ms": ms},
        }  # fmt: skip
        self.staged_slot = slot
        return {"ok": True, "ticket": self.staged["ticket"], "version": slot.version,
                "ready": False}  # fmt: skip

    def staged_draft(self) -> dict:
        if self.staged is None:
            raise SwapError(404, "no draft is staged")
        return {"ok": True, "staged": self.staged}

    def swap_draft(self, path: Any, version: Any = None, sha256: Any = None) -> dict:
        """Install the staged draft when it is this checkpoint, else read it first."""
        slot, ms = self.staged_slot, 0.0
        ahead = (
            slot is not None
            and slot.path == path
            and version in (None, slot.version)
            and sha256 in (None, slot.sha256)
            and slot.version > self.highest
        )
        if not ahead:
            slot, ms = self._read(path, version, sha256)
        self.staged = self.staged_slot = None
        t1 = time.perf_counter()
        self.weights.write(slot.weights)
        install = 1e3 * (time.perf_counter() - t1)
        old = self.current
        self.previous, self.previous_params = old, self.weights.take_saved()
        self.current = replace(slot, weights={})
        self.highest = slot.version
        self.acceptance.begin(slot.version, old.version)
        self.swaps += 1
        log.info("codraft: draft v%d -> v%d", old.version, slot.version)
        return {"ok": True, "ready": True, "prepared_ahead": ahead, "draft": self.info()["draft"],
                "timing_ms": {"read_check_ms": ms, "install_ms": install}}  # fmt: skip

    def load_policy(self, path: Any, version: Any) -> dict:
        """New target weights from a folder (the target's runner only: SGLang's own reload from
        disk would load the same folder into the EAGLE-3 draft too). Requests running meanwhile
        continue on the KV cache they have; their tap messages are not sent (policy changed)."""
        if not isinstance(path, str) or not path:
            raise SwapError(422, f"path must be a non-empty string, got {path!r}")
        if isinstance(version, bool) or not isinstance(version, int):
            raise SwapError(422, f"version must be an integer, got {version!r}")
        check_version_step("policy", version, self.policy.version)
        if version <= self.policy.version:
            raise SwapError(409, f"policy version {version} is not newer than the serving "
                                 f"version {self.policy.version}")  # fmt: skip
        check_policy(path, self.serving)  # every check before the first write
        radix = not getattr(self.scheduler.server_args, "disable_radix_cache", True)
        if radix and not self.scheduler.is_fully_idle():
            raise SwapError(
                409,
                "SGLang's radix cache holds KV of the serving policy and is flushed only when "
                "no request runs: retry when idle, or serve with --disable-radix-cache (the "
                "default with the tap in full mode)",
            )
        try:  # on a failed load SGLang reloads the weights it started with; if that fails too:
            ok, message = self.target_runner.weight_updater.update_weights_from_disk(path, "auto")
        except Exception as e:
            self.policy_broken = policy_broken_message(
                f"loading policy v{version} from {path} failed and SGLang's restore of the "
                f"weights it started with failed too ({type(e).__name__}: {e})"
            )
            log.error("codraft: %s", self.policy_broken)
            raise SwapError(500, self.policy_broken) from None
        if not ok:
            if self.policy_broken is None:
                raise SwapError(500, f"policy reload failed: {message}")
            raise SwapError(500, f"policy reload failed: {message}; {self.policy_broken}")
        self.policy_broken = None
        if radix:
            self.scheduler.flush_cache()
        self.policy = PolicySlot(version, path, utc_now())
        self.acceptance.restart(self.current.version)  # every draft is measured anew
        log.info("codraft: policy v%d loaded from %s", version, path)
        return {"ok": True, "policy": self.policy.info(), "reset_prefix_cache": False}

    def rollback(self, reason: Any = "manual", auto: bool = False) -> dict:
        if self.previous is None or self.previous_params is None:
            raise SwapError(409, "no previous draft to roll back to (one level is kept)")
        self.weights.restore(self.previous_params)
        rolled, self.current = self.current, self.previous
        self.previous = self.previous_params = None
        self.acceptance.restart(self.current.version)
        self.rollbacks += 1
        self.auto_rollbacks += int(auto)
        self._note_rollback(rolled.version, self.current.version, reason, auto, utc_now())
        log.warning("codraft: draft v%d rolled back to v%d (%s)",
                    rolled.version, self.current.version, reason)  # fmt: skip
        return {"ok": True, "draft": self.info()["draft"], "rolled_back_from": rolled.version}

    def set_tap(self, enabled: Any = None, mode: Any = None, sample_rate: Any = None,
                endpoint: Any = None) -> dict:  # fmt: skip
        return self.tap.set(enabled, mode, sample_rate, endpoint)

    def stats(self, flush: Any = False) -> dict:
        if not isinstance(flush, bool):
            raise SwapError(422, f"flush must be true or false, got {flush!r}")
        if flush:
            self.assembler.flush()
        return {
            "ok": True,
            "tap": {
                **self.tap.counters(flush),
                **self.stats_.reported(),
                "steps_skipped": self.copier.steps_skipped,
                "device_bytes_held": self.copier.held_bytes,
                "capture_queue_depth": self.assembler.depth(),
                "hook_errors": self.hook_errors,
                **where_assembled(self.assembler),
            },
            "hooks": {"runner": "sglang-eagle-v2", "steps": self.steps},
            "acceptance": self.acceptance.snapshot(),
            "swaps": self.swaps,
            "rollbacks": self.rollbacks,
            "auto_rollbacks": self.auto_rollbacks,
            "policy_version": self.policy.version,
            "policy_broken": self.policy_broken,
            "draft_version": self.current.version,
        }

    def request_versions(self, request_ids: Any) -> dict:
        if not isinstance(request_ids, list) or not all(isinstance(r, str) for r in request_ids):
            raise SwapError(422, f"request_ids must be a list of strings, got {request_ids!r}")
        versions = {
            r: self.current.version if r in self.running else self.versions_by_request.get(r)
            for r in request_ids
        }
        return {"ok": True, "versions": versions, "current": self.current.version}

    CALLS = {
        "codraft_info": info,
        "codraft_load_draft": swap_draft,
        "codraft_swap_draft": swap_draft,
        "codraft_prepare_draft": prepare_draft,
        "codraft_staged_draft": staged_draft,
        "codraft_rollback_draft": rollback,
        "codraft_load_policy": load_policy,
        "codraft_set_tap": set_tap,
        "codraft_stats": stats,
        "codraft_request_versions": request_versions,
        "codraft_draft_digest": draft_digest,
    }
