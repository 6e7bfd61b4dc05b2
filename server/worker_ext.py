"""The codraft worker extension: capture, tap publishing, live draft swap, policy reload.

Configure it with `worker_extension_cls="codraft.server.worker_ext.CodraftWorkerExtension"`, EAGLE-3
or DFlash speculative decoding (the draft's kind must be the method's), and (optionally)
`additional_config=EngineConfig(...).to_additional_config()`.
vLLM mixes the class into its worker; the methods below are then reachable through
`collective_rpc(name, kwargs=...)` (one result per worker; TP ranks answer alike, take [0]).
They run in the engine's own loop, between engine steps, and never raise: every failure comes
back as `{"ok": False, "status": <HTTP status>, "error": "<message>"}`, so the engine never dies.
Every reply, ok or not, also carries "policy_broken": None, or the message saying that the
target's weights are undefined (see `codraft_load_policy`; the serving side refuses generation
meanwhile, codraft.server.policy_gate). Versions move forward by at most
codraft.server.weights.MAX_VERSION_STEP per load (422 beyond).

Hooks are installed the first time any codraft RPC runs; the engine's owner calls one right
after the engine is built, before serving (`codraft serve` does; `codraft_info()` is enough).

RPC interface (all values plain JSON types):

- `codraft_info()` -> {"ok", "draft": {"version", "sha256", "path", "loaded_at", "kind" ("eagle3"
  or "dflash"), "tap_layers", "previous_version", "highest_version"}, "policy": {"version",
  "path", "loaded_at"}, "tap": {"enabled", "mode", "sample_rate", "endpoint"}, "vllm_version"}
- `codraft_prepare_draft(path, version=None, sha256=None)` -> {"ok", "ticket", "version",
  "ready": False}: starts reading, hashing, checking and staging the checkpoint in a background
  thread (codraft.server.draft_swap); 409 when version is not above the highest one installed
  (a rollback does not lower it: a version names one draft), 404 when path
  does not exist, 422 on malformed arguments. Returns at once. Supersedes the staged draft (one is
  kept). `version` None: the checkpoint's own (409 from the thread when not newer).
- `codraft_commit_draft(ticket)` -> {"ok", "ready": False, "ticket", "elapsed_ms"} while the
  thread runs (or, with "restarted": True and a new ticket, when a file changed since the
  prepare); then {"ok", "ready": True, "draft", "timing_ms": {"queued_ms", "read_check_ms",
  "stage_ms", "prepare_ms", "prepare_cpu_ms", "read_ms", "check_ms", "hash_ms",
  "hash_wait_ms", stage parts, "install_ms"}}, or the preparation's error: 422 when the
  checkpoint fails a check (contract, shapes, vocab, tap layers, checksum, truncated or missing
  files, version differing from its codraft.json), 404, 500 when writing the weights failed (the
  previous draft is restored); 409 for a ticket that is not the latest prepared one or a version
  no longer newer. The previous draft is kept for rollback.
- `codraft_swap_draft(path, version, sha256=None)` -> as `codraft_commit_draft`, plus
  "prepared_ahead": commits the staged draft when it is this checkpoint (files unchanged since
  its prepare), else prepares it (the caller then polls `codraft_commit_draft(ticket)`).
- `codraft_staged_draft()` -> {"ok", "staged": {"ticket", "path", "version", "state":
  "preparing" | "ready" | "failed", "elapsed_ms", "files_changed", "status", "error",
  "sha256", "timing_ms"}}; 404 when no draft is staged.
- `codraft_load_draft(path, version, sha256=None)` -> as a ready commit: both phases in one RPC
  (the engine does not step meanwhile).
- `codraft_rollback_draft(reason="manual")` -> {"ok", "draft", "rolled_back_from"}; 409 when
  there is no previous draft (one level is kept; after a rollback there is none).
- `codraft_load_policy(path, version)` -> {"ok", "policy", "reset_prefix_cache": True}; 409 /
  404 / 422 as for drafts; every check (names, shapes, dtypes of every shard's header, finite
  values: codraft.server.weights.check_policy) before the first write. The caller must reset
  the engine's prefix cache afterwards. Tap messages and stats carry the policy version from
  then on. A load that fails while it streams restores the previous policy (500); when that
  fails too, the target's weights are undefined: the engine is `policy_broken` (500 with the
  message) until a policy loads.
- `codraft_transfer_begin(kind)`, `codraft_transfer_check(version=None)` -> {"ok", "kind",
  "version"}, `codraft_transfer_end(ok, version=None)`, `codraft_sleep(level)`,
  `codraft_wake(tags=None)`: the bracket of a vLLM weight-transfer session and of a sleep
  (codraft.server.transfer); while a session is open the swaps, rollbacks and policy loads
  above answer 409.
- `codraft_draft_digest()` -> {"ok", "version", "tensors": {name: {shape, dtype, device, sum,
  sum_sq}}}: checksums of every tensor the serving draft reads (codraft.server.sleep_copy).
- `codraft_set_tap(enabled=None, mode=None, sample_rate=None, endpoint=None)` -> {"ok", "tap"};
  None leaves a setting unchanged; mode "off" is enabled=False; 422 on bad values.
- `codraft_stats(flush=False)` -> {"ok", "tap": {"messages_sent", "messages_dropped",
  "bytes_sent", "bytes_dropped", "queue_depth", "requests_captured", "requests_incomplete",
  "requests_inconsistent", "requests_sampled_out", "steps_lost", "steps_skipped",
  "device_bytes_held", "capture_queue_depth", "hook_errors"}, "hooks": {"runner": "v1" |
  "v2", "steps", "record_us_per_step", "gather_us_per_step", "deliver_us_per_step"},
  "acceptance": {"<draft version>": {"drafts", "draft_tokens", "accepted_tokens",
  "acceptance_length"}}, "swaps",
  "rollbacks" (manual + automatic), "auto_rollbacks", "policy_version", "draft_version"}.
  `flush=True` first waits (bounded) until what was captured so far is assembled and sent.
- `codraft_request_versions(request_ids)` -> {"ok", "versions": {id: version | None},
  "current"}: the draft version that produced a response is the one current when its request
  finished (a request still running: the current one). Ids may be the caller's (OpenAI) ids:
  vLLM's internal suffix "-xxxxxxxx" and the "<i>_" prefix of n>1 children are matched.

Acceptance is attributed to the draft version that proposed the tokens (the one serving when
the previous step ran). Automatic rollback: see codraft.server.acceptance (the new draft's
acceptance against the previous draft's at the same positions of their requests); it runs at
the start of the next engine step (or RPC) after the verdict.
"""

from __future__ import annotations

import atexit
import functools
import logging
import re
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from codraft.drafters import SERVED_DRAFTERS
from codraft.server import cpu_sampling, hooks
from codraft.server.acceptance import Acceptance, AutoRollback, FinishedVersions
from codraft.server.capture import Capture, StepContext, TapTarget
from codraft.server.compat import require_supported
from codraft.server.device_ring import DeviceRing
from codraft.server.draft_swap import DraftSwapper
from codraft.server.engine_config import EngineConfig
from codraft.server.hooks import RunnerHooks, StepListener, StepRecord
from codraft.server.sleep_copy import digest
from codraft.server.tap_process import TapProcess, publish_from, where_assembled
from codraft.server.tap_switch import TapSwitch
from codraft.server.transfer import TRANSFERRED, Transfers, draft_places
from codraft.server.weights import (
    DraftSlot,
    PolicySlot,
    SwapError,
    check_policy,
    check_version_step,
    folder_layout,
    policy_broken_message,
    read_initial_draft,
    serving_target,
    utc_now,
    write_policy_weights,
)
from codraft.tap.message import DTYPES

log = logging.getLogger(__name__)


def _error(status: int, message: str) -> dict[str, Any]:
    return {"ok": False, "status": status, "error": message}


def _int_arg(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SwapError(422, f"{name} must be a non-negative integer, got {value!r}")
    return value


def _str_arg(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise SwapError(422, f"{name} must be a non-empty string, got {value!r}")
    return value


def request_aliases(req_id: str) -> set[str]:
    """The ids a caller may know an engine request by (see module doc)."""
    keys = {req_id}
    child = re.fullmatch(r"\d+_(.+)", req_id)
    for base in (req_id, child.group(1) if child else None):
        if base is None:
            continue
        keys.add(base)
        plain = re.fullmatch(r"(.+)-[0-9A-Za-z]{8}", base)
        if plain:
            keys.add(plain.group(1))
    return keys


class CodraftEngine(StepListener, AutoRollback):
    """Everything codraft keeps inside one worker (created on the first codraft RPC)."""

    def __init__(self, worker: Any) -> None:
        self.vllm_version = require_supported()
        cpu_sampling.install()  # the plugin's fix, in case this engine was built without it
        self.worker = worker
        self.runner = worker.model_runner
        self.vllm_config = worker.vllm_config
        self.cfg = EngineConfig.from_vllm_config(self.vllm_config)
        self._check_engine()
        from vllm.distributed.parallel_state import get_tp_group

        self.is_sender = get_tp_group().rank_in_group == 0
        spec = self.vllm_config.speculative_config
        self.serving = serving_target(self.vllm_config)
        self.swapper = DraftSwapper(
            self.runner,
            self.vllm_config,
            self.serving["fingerprint"],
            read_initial_draft(spec.draft_model_config.model),
        )
        if self.current.config.kind != spec.method:
            raise SwapError(
                503,
                f"the engine runs speculative method {spec.method!r} with a "
                f"{self.current.config.kind} draft ({spec.draft_model_config.model})",
            )
        taps = tuple(self.current.config.tap_layers)
        self.policy = PolicySlot(0, self.serving["path"], utc_now())
        # Set when a policy load (or a policy weight transfer) failed and left the target's
        # weights undefined: the serving side refuses generation until a policy loads again.
        self.policy_broken: str | None = None
        self.transfers = Transfers()  # vLLM weight-transfer sessions, sleep (server.transfer)
        self.acceptance = Acceptance(self.cfg.rollback_window, self.cfg.rollback_min_requests)
        self.rollback_history: list[dict] = []
        self.proposer_version = self.current.version
        self.pending_rollback: str | None = None
        self.swaps = self.rollbacks = self.auto_rollbacks = 0
        self.versions_by_request = FinishedVersions(self.cfg.request_versions_max)
        self.tap = TapSwitch(
            self.cfg,
            flush=lambda: self.capture.flush(),
            drop=lambda: self.capture.drop_all(),
            sender=self.is_sender,
        )
        model_config = self.vllm_config.model_config
        wire = self.cfg.tap_dtype or {v: k for k, v in DTYPES.items()}.get(
            model_config.dtype, "bfloat16"
        )
        in_process = self.cfg.tap_assembly == "process" and self.is_sender
        # the rows reach the tap process on the device (codraft.server.device_ring)
        ring = (
            DeviceRing(self.runner.device, self.cfg.tap_device_mb << 20)
            if in_process and self.cfg.tap_device_ring
            else None
        )
        self.capture = Capture(
            TapTarget(
                tap_layers=taps,
                hidden_size=int(model_config.hf_config.hidden_size),
                fingerprint=self.serving["fingerprint"],
                dtype=DTYPES[wire],
                max_model_len=int(model_config.max_model_len),
            ),
            want=self.tap.want,
            emit=self.tap.emit,
            draft_version=lambda: self.current.version,
            on_finished=self._finished,
            per_step=self._account,
            max_tokens=self.cfg.tap_max_tokens,
            assembler=functools.partial(TapProcess, ring=ring) if in_process else None,
        )
        publish_from(self.capture.assembler, self.tap)
        try:
            self.tap.apply()
        except SwapError as e:
            log.error("codraft: tap left off: %s", e)
        # Last, once nothing above can fail: a failed start must not leave hooks behind.
        self.hooks = RunnerHooks(
            self.runner, taps, self, DTYPES[wire], self.cfg.tap_device_mb << 20, ring
        )
        try:
            self.hooks.install()
        except Exception:
            self.close()
            raise
        self._wrap_shutdown()
        log.info(
            "codraft: hooks installed (vLLM %s, %s runner, draft v%d, taps %s, tap %s)",
            self.vllm_version,
            self.hooks.kind,
            self.current.version,
            list(taps),
            "on" if self.tap.enabled else "off",
        )

    def _check_engine(self) -> None:
        spec = self.vllm_config.speculative_config
        if spec is None or spec.method not in SERVED_DRAFTERS:
            raise SwapError(
                503,
                f"codraft needs EAGLE-3 or DFlash speculative decoding, found "
                f"{getattr(spec, 'method', None)!r}: start the engine with speculative_config="
                "{'method': 'eagle3' or 'dflash', 'model': <draft folder>, ...}",
            )
        if self.vllm_config.parallel_config.pipeline_parallel_size != 1:
            raise SwapError(503, "codraft does not support pipeline parallelism in the server")

    def _wrap_shutdown(self) -> None:
        runner, original = self.runner, self.runner.shutdown
        me = weakref.ref(self)

        def shutdown(*args: Any, **kwargs: Any) -> Any:
            engine = me()
            if engine is not None:
                engine.close()
            return original(*args, **kwargs)

        runner.shutdown = shutdown
        atexit.register(lambda: me() and me().close())

    def close(self) -> None:
        """Engine shutdown: stop capturing, let the assembly finish, close the publisher."""
        hooks = getattr(self, "hooks", None)
        if hooks is not None:
            hooks.uninstall()
        self.capture.flush()  # what was captured reaches the publisher, which then closes
        self.tap.close_publisher()
        self.capture.close()

    # ------------------------------------------------------------------ engine steps
    def before_step(self, scheduler_output: Any) -> StepContext:
        finished = frozenset(scheduler_output.finished_req_ids or ())
        if finished:
            self.capture.finished_now(finished)
        self.run_pending()
        return StepContext(
            self.capture.new_requests(scheduler_output),
            finished,
            self.policy.version,
            self.proposer_version,
        )

    def rows_wanted(self, slices: list) -> list[int]:
        return self.capture.rows_wanted(slices)

    def after_sample(self) -> None:
        # the drafter just proposed the next step's tokens with the serving draft
        self.proposer_version = self.current.version

    def on_step(self, record: StepRecord, sampled_ids: list[list[int]] | None) -> None:
        self.capture.on_step(record, sampled_ids)

    def _account(self, record: StepRecord, sampled_ids: list[list[int]] | None) -> None:
        """Acceptance per proposing draft version, by step and by request, in step order."""
        if sampled_ids is None or record.context is None:
            return
        version = record.context.proposer_version
        drafts = draft_tokens = accepted = 0
        for s, toks in zip(record.slices, sampled_ids, strict=True):
            if s.num_drafts:
                a = hooks.accepted(s, toks)
                drafts += 1
                draft_tokens += s.num_drafts
                accepted += a
                self.acceptance.observe(s.req_id, version, s.num_drafts, a)
        self.acceptance.record(version, drafts, draft_tokens, accepted)
        if drafts:
            self._check_rollback()

    def run_pending(self) -> None:
        # an automatic rollback waits for an open weight transfer (it would write the draft)
        if self.pending_rollback is not None and self.transfers.session is None:
            reason, self.pending_rollback = self.pending_rollback, None
            if self.previous is not None:
                self.rollback(reason, auto=True)

    # ------------------------------------------------------------------ tap plumbing
    def _finished(self, req_id: str) -> None:
        self.acceptance.close(req_id)
        child = re.fullmatch(r"\d+_(.+)", req_id)  # n > 1: one owner, the parent request
        owner = child.group(1) if child else req_id
        self.versions_by_request.note(request_aliases(req_id), self.current.version, owner)

    # ------------------------------------------------------------------ RPC bodies
    def draft_digest(self) -> dict[str, Any]:
        places = draft_places(self.runner)
        return {"ok": True, "version": self.current.version, "tensors": digest(places)}

    def info(self) -> dict[str, Any]:
        draft = {
            **self.current.info(),
            "previous_version": self.previous.version if self.previous else None,
            "previous_path": self.previous.path if self.previous else None,
            "highest_version": self.swapper.highest,
            "rollbacks": list(self.rollback_history),
        }
        return {
            "ok": True,
            "draft": draft,
            "policy": self.policy.info(),
            "policy_broken": self.policy_broken,
            "tap": self.tap.info(),
            "transfer": self.transfers.info(),
            "vllm_version": self.vllm_version,
        }

    @property
    def current(self) -> DraftSlot:
        return self.swapper.current

    @property
    def previous(self) -> DraftSlot | None:
        return self.swapper.previous

    def swapped(self, reply: dict[str, Any]) -> dict[str, Any]:
        """Bookkeeping after a draft commit (codraft.server.draft_swap) that installed a new
        draft."""
        if not reply.get("ready"):
            return reply
        old, new = self.previous, self.current
        assert old is not None
        self.acceptance.begin(new.version, old.version)
        self.swaps += 1
        log.info("codraft: draft v%d -> v%d (%s)", old.version, new.version, reply["timing_ms"])
        return {**reply, "draft": self.info()["draft"]}

    def rollback(self, reason: Any = "manual", auto: bool = False) -> dict[str, Any]:
        rolled = self.swapper.rollback()
        self.acceptance.restart(self.current.version)
        self.rollbacks += 1
        self.auto_rollbacks += int(auto)
        self._note_rollback(rolled.version, self.current.version, reason, auto, utc_now())
        log.warning(
            "codraft: draft v%d rolled back to v%d (%s)",
            rolled.version,
            self.current.version,
            reason,
        )
        return {"ok": True, "draft": self.info()["draft"], "rolled_back_from": rolled.version}

    def load_policy(self, path: Any, version: Any) -> dict[str, Any]:
        path, version = _str_arg("path", path), _int_arg("version", version)
        self.transfers.refuse_while_open("a policy load")
        check_version_step("policy", version, self.policy.version)
        if version <= self.policy.version:
            raise SwapError(
                409,
                f"policy version {version} is not newer than the serving version "
                f"{self.policy.version}",
            )
        files = check_policy(path, self.serving)  # every check before the first write
        try:
            write_policy_weights(self.runner, self.vllm_config, files)
        except Exception as e:
            log.exception("codraft: policy reload failed; restoring %s", self.policy.path)
            try:
                if self.policy_broken is not None:
                    raise ValueError("the serving weights were undefined before this load")
                if self.policy.path == TRANSFERRED:
                    raise ValueError("the serving policy arrived by weight transfer: no folder")
                old_files = folder_layout(Path(self.policy.path))[0]
                write_policy_weights(self.runner, self.vllm_config, old_files)
            except Exception as e2:
                self.policy_broken = policy_broken_message(
                    f"loading policy v{version} from {path} failed ({e}) and restoring "
                    f"v{self.policy.version} from {self.policy.path} failed too ({e2})"
                )
                log.error("codraft: %s", self.policy_broken)
                raise SwapError(500, self.policy_broken) from None
            raise SwapError(500, f"policy reload failed ({e}); previous policy restored") from None
        self.policy = PolicySlot(version, path, utc_now())
        if self.policy_broken is not None:
            log.warning("codraft: policy v%d loaded: generation is served again", version)
        self.policy_broken = None
        self.acceptance.restart(self.current.version)  # every draft is measured anew
        log.info("codraft: policy v%d loaded from %s", version, path)
        return {"ok": True, "policy": self.policy.info(), "reset_prefix_cache": True}

    def set_tap(
        self, enabled: Any = None, mode: Any = None, sample_rate: Any = None, endpoint: Any = None
    ) -> dict[str, Any]:
        return self.tap.set(enabled, mode, sample_rate, endpoint)

    def stats(self, flush: Any = False) -> dict[str, Any]:
        if not isinstance(flush, bool):
            raise SwapError(422, f"flush must be true or false, got {flush!r}")
        if flush:  # wait for the assembly of what the engine has captured so far
            self.capture.flush()
        return {
            "ok": True,
            "tap": {
                **self.tap.counters(flush),
                **self.capture.stats.reported(),
                "steps_skipped": self.hooks.copier.steps_skipped,
                "device_bytes_held": self.hooks.copier.held_bytes,
                "capture_queue_depth": self.capture.assembler.depth(),
                "hook_errors": self.hooks.errors,
                **where_assembled(self.capture.assembler),
            },
            "hooks": {"runner": self.hooks.kind, **self.hooks.times.to_dict()},
            "acceptance": self.acceptance.snapshot(),
            "swaps": self.swaps,
            "rollbacks": self.rollbacks,
            "auto_rollbacks": self.auto_rollbacks,
            "policy_version": self.policy.version,
            "policy_broken": self.policy_broken,
            "draft_version": self.current.version,
        }

    def request_versions(self, request_ids: Any) -> dict[str, Any]:
        if not isinstance(request_ids, list | tuple) or not all(
            isinstance(r, str) for r in request_ids
        ):
            raise SwapError(422, f"request_ids must be a list of strings, got {request_ids!r}")
        running: set[str] = set()
        for rid in self.capture.running():
            running |= request_aliases(rid)
        versions: dict[str, int | None] = {}
        for rid in request_ids:
            if rid in running:
                versions[rid] = self.current.version
            else:
                versions[rid] = self.versions_by_request.get(rid)
        return {"ok": True, "versions": versions, "current": self.current.version}


class CodraftWorkerExtension:
    """Mixed into vLLM's worker (`worker_extension_cls`); see the module doc for the RPCs."""

    def codraft_info(self) -> dict[str, Any]:
        return self._codraft_call(lambda e: e.info())

    def codraft_load_draft(self, path: str, version: int, sha256: str | None = None) -> dict:
        return self._codraft_swap(lambda e: e.swapped(e.swapper.load(path, version, sha256)))

    def codraft_prepare_draft(
        self, path: str, version: int | None = None, sha256: str | None = None
    ) -> dict[str, Any]:
        return self._codraft_swap(lambda e: e.swapper.prepare(path, version, sha256))

    def codraft_commit_draft(self, ticket: str) -> dict[str, Any]:
        return self._codraft_swap(lambda e: e.swapped(e.swapper.commit(ticket)))

    def codraft_swap_draft(self, path: str, version: int, sha256: str | None = None) -> dict:
        return self._codraft_swap(lambda e: e.swapped(e.swapper.swap(path, version, sha256)))

    def codraft_staged_draft(self) -> dict[str, Any]:
        return self._codraft_call(lambda e: e.swapper.staged())

    def codraft_rollback_draft(self, reason: str = "manual") -> dict[str, Any]:
        return self._codraft_swap(lambda e: e.rollback(f"manual: {reason}"))

    def codraft_transfer_begin(self, kind: str) -> dict[str, Any]:
        return self._codraft_call(lambda e: e.transfers.begin(e, kind))

    def codraft_transfer_check(self, version: int | None = None) -> dict[str, Any]:
        return self._codraft_call(lambda e: e.transfers.check(e, version))

    def codraft_transfer_end(self, ok: bool, version: int | None = None) -> dict[str, Any]:
        return self._codraft_call(lambda e: e.transfers.end(e, ok, version))

    def codraft_sleep(self, level: int) -> dict[str, Any]:
        return self._codraft_call(lambda e: e.transfers.sleep(e, level))

    def codraft_wake(self, tags: list[str] | None = None) -> dict[str, Any]:
        return self._codraft_call(lambda e: e.transfers.wake(e, tags))

    def codraft_draft_digest(self) -> dict[str, Any]:
        return self._codraft_call(lambda e: e.draft_digest())

    def codraft_load_policy(self, path: str, version: int) -> dict[str, Any]:
        return self._codraft_call(lambda e: e.load_policy(path, version))

    def codraft_set_tap(
        self,
        enabled: bool | None = None,
        mode: str | None = None,
        sample_rate: float | None = None,
        endpoint: str | None = None,
    ) -> dict[str, Any]:
        return self._codraft_call(lambda e: e.set_tap(enabled, mode, sample_rate, endpoint))

    def codraft_stats(self, flush: bool = False) -> dict[str, Any]:
        return self._codraft_call(lambda e: e.stats(flush))

    def codraft_request_versions(self, request_ids: list[str]) -> dict[str, Any]:
        return self._codraft_call(lambda e: e.request_versions(request_ids))

    # ------------------------------------------------------------------ plumbing
    def _codraft_swap(self, body: Callable[[CodraftEngine], dict[str, Any]]) -> dict[str, Any]:
        """A draft swap or rollback: refused (409) while a weight transfer is open."""

        def guarded(e: CodraftEngine) -> dict[str, Any]:
            e.transfers.refuse_while_open("a draft swap")
            return body(e)

        return self._codraft_call(guarded)

    def _codraft_call(self, body: Callable[[CodraftEngine], dict[str, Any]]) -> dict[str, Any]:
        try:
            engine = self.__dict__.get("_codraft_state")
            if engine is None:
                engine = CodraftEngine(self)
                self.__dict__["_codraft_state"] = engine
            try:
                engine.run_pending()
            except Exception:
                log.exception("codraft: pending automatic rollback failed")
            try:
                reply = body(engine)
            except SwapError as e:
                reply = _error(e.status, str(e))
            except Exception as e:
                log.exception("codraft RPC failed")
                reply = _error(500, f"{type(e).__name__}: {e}")
            # every reply says whether the target's weights are undefined (the serving side
            # refuses generation meanwhile: codraft.server.policy_gate)
            return {**reply, "policy_broken": engine.policy_broken}
        except SwapError as e:
            return _error(e.status, str(e))
        except Exception as e:
            log.exception("codraft RPC failed")
            return _error(500, f"{type(e).__name__}: {e}")
