"""`codraft learn --server URL --tap ENDPOINT`: train a draft continuously from a live server.

One process, or dp x cp ranks under torchrun (`OnlineConfig.parallel`): rank 0 does everything
below but the training step, which every rank runs on its replica's batch; rank 0 tells the
others what comes next (codraft.learner.online.feed). With pipeline parallelism (pp > 1: the
target recomputed from the token ids, stage by stage, codraft.learner.pipeline_trainer) dp x cp
pipelines of pp stages train; the last stage of replica 0, which holds a draft, is the lead that
does what rank 0 does otherwise. The loop (ingest and HTTP in background threads):

1. ingest validates and buffers the server's tap messages (codraft.learner.online.ingest/buffer):
   over CURVE when the tap endpoint leaves the host (`tap_key`, `tap_allowed_keys`;
   codraft.tap.auth), each message checked against the target, the tap layers, dtype and mode
   this learner trains on, and against the policy and draft versions the server announces
   (read every `announce_every_s` in a thread of its own; a version more than `version_slack`
   ahead is refused);
2. once `min_buffer_tokens` are buffered, the first draft is built: the serving draft's geometry
   (read from its checkpoint when this machine can see it, else the configured one) with a
   vocabulary of the most frequent completion tokens seen so far; or, after a restart, the newest
   whole checkpoint in --out is resumed (model, optimizer, step; a damaged one is skipped,
   codraft.learner.checkpoints) and versions keep increasing;
3. each step trains on random buffered documents (Trainer.step);
4. every `publish_every_steps` the candidate is evaluated on held-out captured requests (offline
   acceptance estimate, codraft.learner.acceptance) against the draft the server is serving, and
   only a candidate that is not worse (within `accept_margin`) is checkpointed (atomically) and
   published; versions are numbered above whatever the server reports. The publish runs in a
   background thread (codraft.learner.online.publish_thread) while training goes on; its outcome is
   applied in the loop, and a stopping learner lets the last publish finish. A checkpoint that
   cannot be written (a full disk) is logged and counted; nothing is published until one is.
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
import signal
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import torch

from codraft.client import CodraftClient
from codraft.client.errors import CodraftConnectionError, CodraftHTTPError
from codraft.draft.checkpoint import AnyDraftConfig, DraftCheckpointError, check_draft, load_draft
from codraft.draft.config import DraftConfig
from codraft.draft.dflash import DFlashDraft
from codraft.draft.dflash_config import DFlashConfig, dflash_tap_layers
from codraft.draft.init import new_dflash_draft
from codraft.draft.model import Eagle3Draft
from codraft.draft.vocab import build_draft_vocab
from codraft.learner.acceptance import estimate_acceptance
from codraft.learner.checkpoints import newest_good
from codraft.learner.data.packing import PackedBatch, Sample, pack
from codraft.learner.dflash_trainer import make_trainer
from codraft.learner.online.buffer import BufferPolicy, SampleBuffer
from codraft.learner.online.feed import (
    EVAL,
    IDLE,
    IDLE_EVERY_S,
    RESUME,
    START,
    STEP,
    STOP,
    BatchFeed,
)
from codraft.learner.online.http import HttpThread, build_app
from codraft.learner.online.ingest import TapIngest, VersionBounds
from codraft.learner.online.metrics import LearnerMetrics
from codraft.learner.online.publish_thread import PublishJob, PublishThread
from codraft.learner.online.publisher import Publisher, PublishOutcome
from codraft.learner.parallel.context import ContextParallel
from codraft.learner.parallel.launch import ParallelConfig, init_distributed, shutdown
from codraft.learner.pipeline_trainer import PipelineLearner, PipelineTrainConfig
from codraft.learner.teacher import load_embedding
from codraft.learner.trainer import TrainConfig, Trainer
from codraft.loopback import is_loopback_host
from codraft.models.config import TargetConfig
from codraft.prepare import resolve_model
from codraft.tap import TapExpectation, model_fingerprint
from codraft.tap.auth import TapKeys

log = logging.getLogger("codraft.learn")


def control_client(cfg: OnlineConfig) -> CodraftClient:
    """The client of the server's control API: `cfg.server_ca` trusted for https (else the
    system's CAs), a warning when the token would cross a network in clear text."""
    warn_plaintext_token(cfg.server, cfg.token)
    return CodraftClient(cfg.server, token=cfg.token, verify=cfg.server_ca or True)


def warn_plaintext_token(url: str, token: str | None) -> None:
    """Log that the control token crosses a network in clear text (an http:// URL off loopback):
    serve the control port with TLS (`codraft serve --ssl-certfile ...`) and pass https://."""
    u = urlsplit(url)
    if token is None or u.scheme != "http" or is_loopback_host(u.hostname or ""):
        return
    log.warning(
        "the control token goes to %s over plain http: anyone on the path can read it; serve "
        "the control port with TLS (codraft serve --ssl-keyfile/--ssl-certfile) and give "
        "--server https://... (--server-ca CA_FILE for a private CA)",
        url,
    )


@dataclass
class OnlineConfig:
    server: str = "http://127.0.0.1:8000"  # the control API (its own port when it has one)
    token: str | None = None
    # an https:// server's certificate is checked against this CA file or folder (None: the
    # system's CAs)
    server_ca: str | None = None
    tap: str = "tcp://127.0.0.1:5557"  # bound here; servers connect
    # CURVE on the tap (codraft.tap.auth), required when `tap` leaves the host: this learner's
    # secret certificate (a *.key_secret file, or a folder holding one) and the folder of the
    # public certificates (*.key) of the servers it accepts
    tap_key: str | None = None
    tap_allowed_keys: str | None = None
    # a message's policy or draft version may be this far ahead of the server's announced one
    version_slack: int = 1
    announce_every_s: float = 5.0  # how often the server's versions are read (GET /ready)
    target: str = "smollm2"
    out: str = "runs/learner"  # checkpoints; must be visible to the server at the same path
    http_host: str = "127.0.0.1"  # a probed pod listens on 0.0.0.0 (k8s passes --http-host)
    http_port: int = 9100  # /health and /metrics; 0 turns it off
    min_buffer_tokens: int = 1024
    publish_every_steps: int = 20
    eval_k: int = 3
    accept_margin: float = 0.02
    max_steps: int | None = None
    max_seconds: float | None = None
    publish_in_background: bool = True  # False: each publish blocks the training loop
    publish_close_timeout_s: float = 60.0  # at shutdown, for the last publish to finish
    # With no checkpoint in `out`, start from the serving draft's weights when it has been
    # trained (its codraft.json counters say step > 0, or it is not codraft's: no counters);
    # False, or an untrained serving draft: a new draft, its vocabulary from the buffer.
    warm_start: bool = True
    train: TrainConfig = field(default_factory=TrainConfig)
    buffer: BufferPolicy = field(default_factory=BufferPolicy)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # under torchrun
    pipeline: PipelineTrainConfig = field(default_factory=PipelineTrainConfig)  # with pp > 1

    def __post_init__(self) -> None:
        if self.version_slack < 0:
            raise ValueError(f"version_slack must be >= 0, got {self.version_slack}")
        if not self.announce_every_s > 0:
            raise ValueError(f"announce_every_s must be > 0, got {self.announce_every_s}")
        # keys required off loopback, and given paths there: checked before anything binds
        self.tap_keys().required(self.tap, "the learner binds the tap on")

    def tap_keys(self) -> TapKeys:
        return TapKeys(self.tap_key, self.tap_allowed_keys)


class OnlineLearner:
    """Collective under torchrun: every rank constructs one and calls `run()`."""

    def __init__(self, cfg: OnlineConfig, client: CodraftClient | None = None) -> None:
        self.cfg = cfg
        self.mesh, device = init_distributed(cfg.parallel)
        dims = self.mesh.dims
        self.pipelined = dims.pp > 1
        # the lead ingests, evaluates, checkpoints and publishes: a rank that holds the draft
        self.lead = dims.rank_of(dims.pp - 1, 0, 0)
        self.main = self.mesh.rank == self.lead
        # the ranks that train a draft and receive batches: every rank, or the last stages
        self.data_ranks = [dims.rank_of(dims.pp - 1, d, c)
                           for d in range(dims.dp) for c in range(dims.cp)]  # fmt: skip
        several = dims.world_size > 1 and not self.pipelined
        self.parallel = ContextParallel(self.mesh) if several else None
        if self.parallel is not None:
            self.pad_multiple = self.parallel.pad_multiple
        else:  # one process, or pipelines: zigzag halves only with cp > 1 (as offline)
            self.pad_multiple = 2 * dims.cp if dims.cp > 1 else 1
        self.train_cfg = replace(cfg.train, device=str(device))
        self.device = device
        self.feed = BatchFeed(self.mesh, device, lead=self.lead)
        self.pipe: PipelineLearner | None = None  # with pp > 1: this rank's stage
        self.target_dir = resolve_model(cfg.target)
        self.target_config = TargetConfig.from_pretrained(self.target_dir)
        self.client = client or control_client(cfg)
        self.publisher = Publisher(self.client)
        background = cfg.publish_in_background and self.main
        self.publishing = PublishThread(self._timed_publish) if background else None
        self.metrics = LearnerMetrics()
        self.buffer = SampleBuffer(cfg.buffer, seed=cfg.train.seed)
        self.serving_vocab_fixed = False  # set from the serving draft's info (GET /v1/draft)
        # ids-only messages need a learner that runs the target (--recompute, --pp); any
        # other refuses them at ingest, counted under "mode", instead of failing its step
        recomputes = self.pipelined or cfg.train.recompute
        # Tap layers are pinned from the start: to those of the draft this learner would build
        # (--tap-layers, else the drafter's default for the target), then to the serving
        # draft's once the server is read, then to the trained draft's (TapIngest.repin). The
        # dtype (and the mode, when open) is pinned to the first message accepted.
        self._served_taps: tuple[int, ...] | None = None  # the serving draft's, when read
        self.expect = TapExpectation(
            fingerprint=model_fingerprint(self.target_config),
            hidden_size=self.target_config.hidden_size,
            vocab_size=self.target_config.vocab_size,
            mode=None if recomputes else "full",
            tap_layers=self._configured_taps(),
        )
        # Until the server has announced its versions, only versions within the slack of 0 are
        # taken: a learner that cannot read the server takes nothing from ahead of it.
        self.bounds = VersionBounds(policy=0, draft=0, slack=cfg.version_slack)
        keys = cfg.tap_keys()
        # rank 0 alone binds the tap endpoint and buffers (codraft.learner.online.feed says why)
        self.ingest = (
            TapIngest(cfg.tap, self.buffer, self.expect, keys=keys, bounds=self.bounds)
            if self.main
            else None
        )
        self._announcer: threading.Thread | None = None
        self._announced_ok: bool | None = None  # whether the last read of them worked
        self._batches: list[PackedBatch] | None = None  # rank 0: the next step's, one a replica
        # the lead, pipelines: the held-out requests a publish waits on (the EVAL command)
        self._eval_held: list[Sample] = []
        self._saved_step = 0  # the step of the newest checkpoint written or resumed
        self._resume_from: bool | None = None  # whether --out has a whole checkpoint
        self._saved_policy = 0  # the newest policy version in that checkpoint's data
        self._waited = 0.0  # seconds this rank waited for its next step
        self.trainer: Trainer | None = None
        self.serving: Eagle3Draft | DFlashDraft | None = None  # the server's, for comparisons
        self.stop_event = threading.Event()
        self.published: list[int] = []
        self._superseded_seen = 0
        self.http: HttpThread | None = None

    # ------------------------------------------------------------------ lifecycle
    def health(self) -> dict:
        out = {
            "status": "ok",
            "rank": self.mesh.rank,
            "world_size": self.mesh.dims.world_size,
            "step": self.trainer.step_count if self.trainer else 0,
            "trained_tokens": self.trainer.tokens_seen if self.trainer else 0,
            "wait_seconds": round(self._waited, 3),
        }
        if self.main:
            out.update(
                draft_version=self.trainer.draft_version if self.trainer else None,
                buffered_samples=len(self.buffer),
                tap_accepted=self.ingest.stats.accepted,
                ingested_tokens=self.ingest.stats.accepted_tokens,
                tap_rejected=dict(self.ingest.stats.rejected),
                published=self.published,
            )
        return out

    def run(self) -> dict:
        """Train until stopped (a signal, max_steps, max_seconds); the health summary."""
        if self.main:
            self._announcer = threading.Thread(
                target=self._watch_server, name="codraft-announced", daemon=True
            )
            self._announcer.start()
            self.ingest.start()
            log.info(
                "listening for taps on %s (%s); server %s", self.ingest.bound,
                "CURVE" if self.ingest.curve else "plaintext, loopback", self.cfg.server,
            )  # fmt: skip
        if self.cfg.http_port:  # every rank: its own port, 9100 + its local rank
            app = build_app(self.metrics.registry, self.health)
            port = self.cfg.http_port + int(os.environ.get("LOCAL_RANK", "0"))
            self.http = HttpThread(app, self.cfg.http_host, port).start()
        self._t0 = time.monotonic()
        clean = False
        try:
            while True:
                t = time.monotonic()
                op = self.feed.command(self._next_op() if self.main else IDLE)
                self._wait(time.monotonic() - t)
                if op == STOP:
                    if self.main:
                        self._save_on_stop()
                    break
                if op in (START, RESUME):
                    self._start_trainer(resume=op == RESUME)
                elif op == STEP:
                    self._train_step()
                    if self.main and self.trainer.step_count % self.cfg.publish_every_steps == 0:
                        self._eval_held = self._pipeline_eval()
                        if not self._eval_held:  # else the next command: their features
                            self.maybe_publish()
                elif op == EVAL:
                    held = self._held_features()
                    if self.main:
                        self.maybe_publish(held)
            clean = True
        finally:
            if self.publishing is not None:
                self.publishing.close(self.cfg.publish_close_timeout_s)
                self._apply_published()
            if self.ingest is not None:
                self.ingest.stop()
            if self._announcer is not None:
                self.stop_event.set()
                self.bounds.ahead.set()
                self._announcer.join(timeout=5)
            if self.pipe is not None:
                self.pipe.close()
            if self.http:
                self.http.stop()
            if clean and self.mesh.dims.world_size > 1:
                shutdown()
        return self.health()

    def _next_op(self) -> int:
        """Rank 0: what every rank does next. Waits (at most IDLE_EVERY_S) for something to do."""
        deadline = time.monotonic() + IDLE_EVERY_S
        while True:
            if self._eval_held:  # first: a stop after the last step still publishes it
                return EVAL
            if self._should_stop():
                return STOP
            self._export_gauges()
            self._apply_published()
            if self.trainer is None:
                if self._resumable():
                    return RESUME
                if self.buffer.tokens >= self.cfg.min_buffer_tokens:
                    return START
            else:
                draws = [self.buffer.draw(self.cfg.train.token_budget)
                         for _ in range(self.mesh.dp_size)]  # fmt: skip
                if all(draws):
                    try:
                        self._batches = [pack(d, pad_multiple=self.pad_multiple) for d in draws]
                    except ValueError as e:  # ingest pins what packs together: not expected
                        log.error("buffered samples do not pack (%s): buffer emptied", e)
                        self.buffer.clear("unpackable")
                        continue
                    return STEP
            if time.monotonic() >= deadline:
                return IDLE
            time.sleep(0.1 if self.trainer is not None else 0.2)

    def _watch_server(self) -> None:
        """Rank 0's thread: the server's announced versions into the ingest's bounds, and the
        serving draft's tap layers into its expectation while none are pinned, every
        `announce_every_s` until the learner stops, and at once (at most every 0.2 s) after a
        message was refused as ahead of them: the server may have moved on since."""
        while not self.stop_event.is_set():
            self.bounds.ahead.clear()
            self.read_announced()
            if self.bounds.ahead.wait(self.cfg.announce_every_s):
                self.stop_event.wait(0.2)

    def read_announced(self) -> bool:
        """One read of the server's versions (GET /ready, GET /v1/draft); False when the
        server did not answer (the bounds stay as they were)."""
        try:
            ready = self.client.ready()
            info = self.client.draft()
        except (CodraftConnectionError, CodraftHTTPError) as e:
            if self._announced_ok is not False:  # once a failure streak: not every few seconds
                log.warning(
                    "cannot read the server's versions (%s); tap messages stay bounded by the "
                    "last ones read (policy %s, draft %s, +%d)",
                    e, self.bounds.policy, self.bounds.draft, self.bounds.slack,
                )  # fmt: skip
            self._announced_ok = False
            return False
        self._announced_ok = True
        if ready.policy_version is not None:
            self.bounds.policy = max(self.bounds.policy or 0, int(ready.policy_version))
        served = [v for v in (ready.draft_version, info.version, info.highest_version)
                  if v is not None]  # fmt: skip
        if served:
            self.bounds.draft = max([self.bounds.draft or 0, *served])
        if info.tap_layers:  # what the server taps: its draft's
            served = tuple(int(t) for t in info.tap_layers)
            if (info.kind or "eagle3") == self.cfg.train.drafter:  # a new draft of that kind
                self._served_taps = served
            if self.trainer is None and self.ingest is not None:  # after: the draft's rule
                self.ingest.repin(served)
        return True

    def _configured_taps(self) -> tuple[int, ...]:
        """The tap layers of a new draft built without the serving draft's: --tap-layers, else
        the drafter's default for the target."""
        t = self.cfg.train
        if t.tap_layers:
            return tuple(int(x) for x in t.tap_layers)
        if t.drafter == "eagle3":
            return tuple(self.target_config.default_tap_layers())
        return dflash_tap_layers(self.target_config.num_hidden_layers)

    def _wait(self, seconds: float) -> None:
        self._waited += seconds
        self.metrics.wait_seconds.inc(seconds)

    def _resumable(self) -> bool:
        """Whether --out holds a whole checkpoint to resume from (looked up once)."""
        if self._resume_from is None:
            self._resume_from = newest_good(self.cfg.out) is not None
        return self._resume_from

    def _checkpoint(self, **kwargs: Any) -> Path | None:
        """`trainer.save`, or None when the write failed (a full disk, a lost volume): the
        error is logged and counted, the checkpoint before stays the newest, its version is
        not used up, and training goes on (the next publish tries again)."""
        trainer = self.trainer
        version = trainer.draft_version
        try:
            ckpt = trainer.save(**kwargs)
        except Exception as e:  # torch.save reports a full disk as a RuntimeError
            trainer.draft_version = version
            self.metrics.checkpoint_failures.inc()
            try:
                free = f"{shutil.disk_usage(self.cfg.out).free} bytes free"
            except OSError:
                free = "free space unknown"
            log.error(
                "checkpoint of step %d not written to %s (%s: %s; %s): nothing is published "
                "until a checkpoint is written; the newest checkpoint stays %s",
                trainer.step_count, self.cfg.out, type(e).__name__, e, free,
                newest_good(self.cfg.out),
            )  # fmt: skip
            return None
        self._saved_step = trainer.step_count
        return ckpt

    def _save_on_stop(self) -> None:
        """A stopping learner keeps what it trained since its last checkpoint (not published:
        the next publish takes a newer version)."""
        trainer = self.trainer
        if trainer is None:
            return
        if trainer.step_count != self._saved_step:
            self._saved_policy = self.buffer.newest_policy
            self._checkpoint(policy_version=self._saved_policy)
        log.info("stopped at step %d: checkpoint v%d", trainer.step_count, trainer.draft_version)

    def _should_stop(self) -> bool:
        if self.stop_event.is_set():
            return True
        if self.cfg.max_seconds and time.monotonic() - self._t0 > self.cfg.max_seconds:
            return True
        steps = self.trainer.step_count if self.trainer else 0
        return bool(self.cfg.max_steps and steps >= self.cfg.max_steps)

    def install_signal_handlers(self) -> None:
        """SIGINT/SIGTERM stop the learner after its step, on every rank alike. torchrun (and a
        pod's termination, through it) signals all ranks at once: rank 0 then sends STOP with
        its next command and saves a checkpoint, and the other ranks, which only ever follow
        rank 0's commands, leave when STOP arrives, instead of dying mid-step under rank 0's
        collective. A second signal ends a rank at once (the default handling is back). When
        a rank died, the survivors' next collective fails on its closed sockets anyway."""

        def stop(sig: int, _frame: object) -> None:
            self.stop_event.set()
            signal.signal(sig, signal.SIG_DFL)

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, stop)

    # ------------------------------------------------------------------ pieces
    def _serving_config(self) -> tuple[AnyDraftConfig | None, Path | None]:
        try:
            info = self.client.draft()
        except (CodraftConnectionError, CodraftHTTPError) as e:
            log.warning("cannot read the serving draft yet: %s", e)
            return None, None
        self.metrics.serving_version.set(info.version or 0)
        self.serving_vocab_fixed = info.vocab_map_fixed
        if not info.path or not Path(info.path).is_dir():
            return None, None
        try:
            cfg, _ = check_draft(info.path)
        except DraftCheckpointError as e:
            log.warning("serving draft unreadable here: %s", e)
            return None, None
        return cfg, Path(info.path)

    def _start_trainer(self, resume: bool) -> None:
        """Every rank: resume from --out's newest checkpoint, or start from rank 0's new draft."""
        out = Path(self.cfg.out)
        serving_cfg, serving_path = self._serving_config() if self.main else (None, None)
        if self.pipelined:
            self._start_pipeline(resume, serving_cfg, serving_path)
        elif resume:
            good = newest_good(out)
            if good is None:
                raise RuntimeError(
                    f"rank {self.mesh.rank} finds no whole checkpoint in {out}, which rank 0 "
                    "resumes from: --out must be a folder every learner rank sees (a shared "
                    "volume)"
                )
            draft, _ = load_draft(good / "draft")
        else:
            first = self._first_draft(serving_cfg, serving_path) if self.main else None
            draft = self.feed.share_draft(first)
        if not self.pipelined:
            # the kind the server serves (a draft of another kind would be refused there)
            train_cfg = replace(self.train_cfg, drafter=draft.config.kind)
            self.trainer = make_trainer(
                self.target_dir, out, train_cfg, draft=draft,
                target_config=self.target_config, parallel=self.parallel,
            )  # fmt: skip
            self.trainer.resume()
            self._saved_step = self.trainer.step_count
        if not self.main:
            return
        self._pin_draft_taps()
        if serving_path is not None:
            try:
                served, _ = load_draft(serving_path)
                embedding = load_embedding(
                    self.target_dir, device=self.trainer.device, config=self.target_config
                )
                if isinstance(served, DFlashDraft):  # the target's embedding and lm_head
                    served.set_target_head(embedding, self.trainer.draft.head_weight())
                else:
                    served.set_embedding(embedding)
                self.serving = served.to(self.trainer.device).eval()
            except (DraftCheckpointError, ValueError) as e:
                log.warning("cannot load the serving draft for comparisons: %s", e)
        self._sync_version()
        log.info(
            "training draft from step %d, version %d (vocab %d, taps %s)",
            self.trainer.step_count, self.trainer.draft_version,
            self.trainer.draft.config.draft_vocab_size,
            list(self.trainer.draft.config.tap_layers),
        )  # fmt: skip

    def _pin_draft_taps(self) -> None:
        """The draft being trained reads its tap layers: messages of others are refused from
        now on, and a buffer filled with others is emptied (never a step that cannot run)."""
        if self.trainer is not None and self.ingest is not None:
            self.ingest.repin(tuple(self.trainer.draft.config.tap_layers))

    def _start_pipeline(
        self, resume: bool, serving_cfg: AnyDraftConfig | None, serving_path: Path | None
    ) -> None:
        """Every rank of the pipeline: its stage of the target; the lead (the last stage) the
        trainer, from --out's newest checkpoint or its new draft. Collective."""
        if serving_cfg is not None and serving_cfg.kind != "eagle3":
            raise ValueError(
                f"the server serves a {serving_cfg.kind} draft; the pipelined learner (--pp) "
                "trains EAGLE-3 drafts only: run it without --pp"
            )
        draft, out = None, Path(self.cfg.out)
        if resume and self.mesh.pp_rank == self.mesh.dims.pp - 1:
            good = newest_good(out)
            assert good is not None, f"rank 0 resumes from {out}, where this rank finds nothing"
            draft, _ = load_draft(good / "draft")
        elif not resume:
            first = self._first_draft(serving_cfg, serving_path) if self.main else None
            draft = self.feed.share_draft(first)  # the other stages drop theirs
        self.pipe = PipelineLearner.load(
            self.target_dir, self.cfg.out, self.train_cfg, self.cfg.pipeline, self.mesh,
            self.device, target_config=self.target_config, draft=draft,
        )  # fmt: skip
        self.trainer = self.pipe.trainer  # on every last stage; None on the stages before
        if self.trainer is not None:
            self.trainer.resume()
            self._saved_step = self.trainer.step_count

    def _first_draft(
        self, serving_cfg: AnyDraftConfig | None, path: Path | None
    ) -> Eagle3Draft | DFlashDraft:
        """Rank 0, no checkpoint in --out: the serving draft's weights when it was trained (a
        learner that lost its volume, or joins a server already serving a good draft, goes on
        from there instead of training up to it again), else a new draft."""
        if not self.cfg.warm_start or path is None or serving_cfg is None:
            return self._new_draft(serving_cfg, path)
        try:
            served, meta = load_draft(path)
        except (DraftCheckpointError, ValueError) as e:
            log.warning("cannot start from the serving draft: %s; a new draft instead", e)
            return self._new_draft(serving_cfg, path)
        if meta.counters.get("step", 1) == 0:
            return self._new_draft(serving_cfg, path)  # never trained: new weights
        fp32 = replace(serving_cfg, dtype="float32")
        draft = DFlashDraft(fp32) if isinstance(fp32, DFlashConfig) else Eagle3Draft(fp32)
        draft.load_state_dict(served.state_dict(), strict=True)
        log.info("no checkpoint in %s: starting from the serving draft v%d (%s)",
                 self.cfg.out, meta.version, path)  # fmt: skip
        return draft

    def _new_draft(
        self, serving_cfg: AnyDraftConfig | None, serving_path: Path | None = None
    ) -> Eagle3Draft | DFlashDraft:
        """A new draft of the serving draft's kind and shape (without one: of --drafter's); its
        vocabulary the most frequent tokens in the buffer, or the serving draft's where the
        engine keeps the map it started with (`vocab_map_fixed`, SGLang)."""
        t = self.cfg.train
        kind = serving_cfg.kind if serving_cfg is not None else t.drafter
        if kind == "dflash":
            if isinstance(serving_cfg, DFlashConfig):
                torch.manual_seed(t.seed)
                return DFlashDraft(replace(serving_cfg, dtype="float32"))
            return new_dflash_draft(
                self.target_config, mask_token_id=t.mask_token_id,
                num_hidden_layers=t.dflash_layers, block_size=t.block_size,
                tap_layers=self._served_taps or t.tap_layers, seed=t.seed,
            )  # fmt: skip
        if serving_cfg is not None:
            cfg = serving_cfg
            cfg = DraftConfig(**{**cfg.to_dict(), "dtype": "float32"})
        else:
            cfg = DraftConfig.from_target(
                self.target_config,
                draft_vocab_size=min(t.draft_vocab_size, self.target_config.vocab_size),
                tap_layers=self._served_taps or t.tap_layers,  # what the server taps
                dtype="float32",
            )
        if self.serving_vocab_fixed and serving_cfg is not None and not cfg.full_vocab:
            vocab = self._serving_vocab(serving_path)
        else:
            counts = torch.zeros(self.target_config.vocab_size, dtype=torch.int64)
            for s in self.buffer.all_samples():
                ids = s.token_ids.to(torch.int64)[s.loss_mask.bool()]
                counts += torch.bincount(ids, minlength=len(counts))
            vocab = build_draft_vocab(counts, cfg.draft_vocab_size)
        torch.manual_seed(t.seed)
        draft = Eagle3Draft(cfg)
        draft.set_vocab(*vocab)
        return draft

    def _serving_vocab(self, path: Path | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The serving draft's (d2t, t2d), which a draft for an engine with a fixed vocabulary
        map must keep (the engine refuses any other)."""
        try:
            if path is None:
                raise DraftCheckpointError("the server names no draft folder this learner sees")
            served, _ = load_draft(path)
        except (DraftCheckpointError, ValueError) as e:
            raise RuntimeError(
                "the server keeps the vocabulary map of the draft it started with (it says "
                f"vocab_map_fixed), so a new draft must carry that map, but the serving draft "
                f"cannot be read here: {e}. Give the learner the server's checkpoint folder "
                "(a shared volume) or start the server with a draft trained by this learner"
            ) from e
        return served.d2t.detach().cpu().clone(), served.t2d.detach().cpu().clone()

    def _sync_version(self) -> None:
        try:
            server = self.publisher.newest_version() or 0
        except (CodraftConnectionError, CodraftHTTPError):
            return
        if self.trainer and self.trainer.draft_version < server:
            self.trainer.draft_version = server

    def _train_step(self) -> None:
        """Every rank: one step on its replica's batch (rank 0 drew them in `_next_op`)."""
        if self.pipe is not None:  # a last stage's batch goes down its pipeline's broadcast
            batch = None
            if self.main:
                batches, self._batches = self._batches, None
                batch = self.feed.send_batches(batches, to=self.data_ranks)
            elif self.mesh.rank in self.data_ranks:
                t = time.monotonic()
                batch = self.feed.recv_batch()
                self._wait(time.monotonic() - t)
            m = self.pipe.step(batch)
            self.metrics.steps.inc()
            if self.trainer is not None:
                self.metrics.tokens.inc(m.tokens)
                self.metrics.loss.set(m.loss)
            return
        if self.main:
            batches, self._batches = self._batches, None
            batch = self.feed.send_batches(batches)
        else:
            t = time.monotonic()
            batch = self.feed.recv_batch()
            self._wait(time.monotonic() - t)
        m = self.trainer.step(batch)
        self.metrics.steps.inc()
        self.metrics.tokens.inc(m.tokens)  # this rank's replica's tokens
        self.metrics.loss.set(m.loss)  # the whole step's

    def _export_gauges(self) -> None:
        st = self.ingest.stats
        self.metrics.tap_accepted.set(st.accepted)
        self.metrics.ingested_tokens.set(st.accepted_tokens)
        self.metrics.buffer_fill.set(self.buffer.tokens / max(1, self.buffer.policy.max_tokens))
        self.metrics.buffer_bytes.set(self.buffer.nbytes)
        for reason, n in self.buffer.stats.evicted.items():
            self.metrics.buffer_evicted.labels(reason=reason).set(n)
        self.metrics.policy_version.set(self.buffer.newest_policy)
        self.metrics.policy_lag.set(self.buffer.newest_policy - self._saved_policy)
        for reason, n in st.rejected.items():
            self.metrics.tap_rejected.labels(reason=reason).set(n)
        self.metrics.buffer_samples.set(len(self.buffer))
        self.metrics.buffer_tokens.set(self.buffer.tokens)

    def _pipeline_eval(self) -> list[Sample]:
        """The lead: the held-out requests (token ids only) that the pipelines must run the
        target over before a candidate can be compared; none without pipeline parallelism or
        when every held-out request came with its features."""
        held = self.buffer.holdout()
        if self.pipe is None or all(s.taps is not None for s in held):
            return []
        return [Sample(s.token_ids, s.loss_mask, request_id=s.request_id) for s in held]

    def _held_features(self) -> list[Sample] | None:
        """EVAL, every rank: the lead sends its held-out requests (token ids only) to the last
        stages of replica 0, their pipelines run the target over them, and the lead gets them
        back with the target's features; None on every other rank. The other replicas sit it
        out: their pipelines are groups of their own."""
        if self.mesh.dp_rank != 0:
            return None
        held, batch = [], None
        if self.main:
            held, self._eval_held = self._eval_held, []
            packed = pack(held, pad_multiple=self.pad_multiple)
            replica0 = [r for r in self.data_ranks if self.mesh.dims.coords(r)[1] == 0]
            batch = self.feed.send_batches([packed] * self.mesh.dp_size, to=replica0)
        elif self.mesh.rank in self.data_ranks:
            batch = self.feed.recv_batch()
        full = self.pipe.features(batch)
        if not self.main:
            return None
        cu = full.cu_seqlens.tolist()
        return [
            replace(s, taps=full.taps[a : a + len(s)], last_hidden=full.last_hidden[a : a + len(s)])
            for s, a in zip(held, cu, strict=False)
        ]

    def evaluate(
        self, draft: Eagle3Draft | DFlashDraft, held: list[Sample] | None = None
    ) -> float | None:
        """The draft's acceptance estimate on held-out captured requests (`held`: those with
        the features the pipelines computed); None when there are none, or when they came
        without features (ids-only taps) and no teacher here can run the target: then the
        candidate is published without the comparison."""
        held = held if held is not None else self.buffer.holdout()
        if not held:
            return None
        teacher = None
        if any(s.taps is None for s in held):
            if self.trainer.teacher.mode != "recompute":
                return None
            teacher = self.trainer.teacher
        return estimate_acceptance(draft, teacher, held, k=self.cfg.eval_k).acceptance_length

    def maybe_publish(self, held: list[Sample] | None = None) -> bool:
        """Checkpoint and publish the candidate if it is not worse than the serving draft
        (compared on `held`, when given: the held-out requests with their features)."""
        trainer = self.trainer
        cand = self.evaluate(trainer.draft, held)
        serving = self.evaluate(self.serving, held) if self.serving is not None else None
        if cand is not None:
            self.metrics.candidate_acceptance.set(cand)
        if serving is not None:
            self.metrics.serving_acceptance.set(serving)
        if cand is not None and serving is not None and cand < serving - self.cfg.accept_margin:
            log.info("candidate %.3f < serving %.3f: not published", cand, serving)
            self.metrics.candidates_skipped.inc()
            return False
        self._saved_policy = self.buffer.newest_policy
        ckpt = self._checkpoint(
            counters={"est_acceptance": cand or 0.0}, policy_version=self._saved_policy
        )
        if ckpt is None:
            return False
        job = PublishJob(
            trainer.draft_dir(ckpt),
            trainer.draft_version,
            payload={"draft": copy.deepcopy(trainer.draft).eval(), "acceptance": cand},
        )
        if self.publishing is not None:
            self.publishing.submit(job)
            return True
        job.outcome = self._timed_publish(job.draft_dir)
        return self._apply(job)

    def _timed_publish(self, draft_dir: Path) -> PublishOutcome:
        t0 = time.monotonic()
        outcome = self.publisher.publish(draft_dir)
        self.metrics.publish_seconds.set(time.monotonic() - t0)
        return outcome

    def _apply_published(self) -> None:
        """Apply the outcomes of background publishes that finished."""
        if self.publishing is None:
            return
        for job in self.publishing.drain():
            self._apply(job)
        superseded = self.publishing.superseded
        self.metrics.publish_superseded.inc(superseded - self._superseded_seen)
        self._superseded_seen = superseded

    def _apply(self, job: PublishJob) -> bool:
        outcome = job.outcome
        assert outcome is not None, "a publish job is applied only once it has its outcome"
        if outcome.ok:
            self.published.append(job.version)
            self.bounds.draft = max(self.bounds.draft or 0, job.version)  # the server's now
            self.metrics.published.inc()
            self.metrics.serving_version.set(job.version)
            self.serving = job.payload["draft"]
            est = job.payload["acceptance"]
            log.info("published draft v%d (est. acceptance %s)", job.version, est)
            return True
        self.metrics.publish_failures.labels(status=str(outcome.status)).inc()
        if outcome.status == 409 and outcome.server_version is not None and self.trainer:
            self.trainer.draft_version = max(self.trainer.draft_version, outcome.server_version)
        return False
