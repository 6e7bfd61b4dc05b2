"""The learner's Prometheus metrics (one registry per daemon, so tests can run several)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class LearnerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.steps = Counter("codraft_learner_steps", "optimizer steps", registry=r)
        self.tokens = Counter("codraft_learner_tokens", "tokens trained on", registry=r)
        self.loss = Gauge("codraft_learner_loss", "last training loss", registry=r)
        self.tap_accepted = Gauge("codraft_learner_tap_accepted", "messages accepted", registry=r)
        self.tap_rejected = Gauge(
            "codraft_learner_tap_rejected",
            "messages refused at ingest, by reason (codraft.tap.REASONS and the ingest's own: "
            "policy_ahead, draft_ahead, auth, ...)",
            ["reason"],
            registry=r,
        )
        self.buffer_samples = Gauge("codraft_learner_buffer_samples", "buffered", registry=r)
        self.buffer_tokens = Gauge("codraft_learner_buffer_tokens", "buffered tokens", registry=r)
        self.buffer_bytes = Gauge(
            "codraft_learner_buffer_bytes", "bytes the buffered samples hold", registry=r
        )
        self.buffer_evicted = Gauge(
            "codraft_learner_buffer_evicted",
            "training samples evicted from the buffer (size, bytes, age, policy, tap_layers)",
            ["reason"],
            registry=r,
        )
        self.published = Counter("codraft_learner_published", "drafts the server took", registry=r)
        self.publish_failures = Counter(
            "codraft_learner_publish_failures", "publish attempts refused", ["status"], registry=r
        )
        self.publish_superseded = Counter(
            "codraft_learner_publish_superseded",
            "checkpoints replaced by a newer one before their publish started",
            registry=r,
        )
        self.publish_seconds = Gauge(
            "codraft_learner_publish_seconds", "last publish: prepare, staging, commit", registry=r
        )
        self.checkpoint_failures = Counter(
            "codraft_learner_checkpoint_failures",
            "checkpoints that could not be written (full disk, lost volume)",
            registry=r,
        )
        self.candidates_skipped = Counter(
            "codraft_learner_candidates_skipped", "candidates worse than serving", registry=r
        )
        self.serving_version = Gauge("codraft_learner_serving_version", "server's", registry=r)
        self.candidate_acceptance = Gauge(
            "codraft_learner_candidate_acceptance", "estimated acceptance length", registry=r
        )
        self.serving_acceptance = Gauge(
            "codraft_learner_serving_acceptance", "estimated acceptance length", registry=r
        )
        # backpressure: each rank reports its own; the ingest figures are rank 0's
        self.wait_seconds = Counter(
            "codraft_learner_wait_seconds",
            "seconds this rank spent waiting for its next step (rank 0: for data; the others: "
            "for rank 0's command and batch)",
            registry=r,
        )
        self.ingested_tokens = Gauge(
            "codraft_learner_ingested_tokens", "tokens accepted from the tap (rank 0)", registry=r
        )
        self.buffer_fill = Gauge(
            "codraft_learner_buffer_fill", "buffered tokens / the buffer's bound", registry=r
        )
        self.policy_version = Gauge(
            "codraft_learner_policy_version",
            "newest policy version in the data the learner has taken in",
            registry=r,
        )
        self.policy_lag = Gauge(
            "codraft_learner_policy_lag",
            "newest policy version seen minus the newest in the last checkpoint's data",
            registry=r,
        )
