"""`codraft serve --engine sglang`: SGLang's own OpenAI-compatible server with codraft inside.

SGLang's HTTP server (`sglang.srt.entrypoints.http_server`, its OpenAI routes, streaming,
/generate, ...) runs as `python -m sglang.launch_server` runs it, with:

* speculative decoding with codraft's draft: EAGLE-3 (a chain: topk 1), started from an SGLang
  view of the codraft checkpoint (`sglang_view`: its config with SGLang's tap numbering, the
  same weights file), or DFlash (SGLang reads codraft's DFlash folder as it is);
* codraft's engine in the scheduler process (codraft.server.sglang.plugin, enabled through the
  environment), reached over codraft's own control socket (codraft.server.sglang.rpc);
* codraft's control routes (/v1/draft, /v1/draft/prepare, /v1/draft/rollback,
  /v1/draft/digest, /v1/policy, /v1/tap, /v1/stats) in front of SGLang's routes, or on a port
  of their own with --control-port (a second server in SGLang's event loop, started and stopped
  with SGLang's app); /ready and /metrics on the OpenAI port either way; the
  X-Codraft-Draft-Version / X-Codraft-Policy-Version headers on /v1/completions and
  /v1/chat/completions; the policy gate (codraft.server.policy_gate: 503 for generation while
  the target's weights are undefined, SGLang's weight routes exempt). SGLang's own --api-key
  guards its routes.

What the vLLM engine has and this one does not yet: vLLM's RL weight-sync routes, draft
preparation in the background (`POST /v1/draft/prepare` reads and checks between two batches;
a draft is small). SGLang's multi-process HTTP front ends (--tokenizer-worker-num > 1, the
HTTP/2 server) import a fresh app in each worker, without codraft's routes: refused.
Arguments `codraft serve` does not know go to SGLang's own parser (e.g.
`--mem-fraction-static 0.5`). SGLang's admin routes
(/update_weights_from_tensor, /release_memory_occupation, /flush_cache, ...) stay SGLang's,
guarded by its `--admin-api-key` when given (bind to loopback, the default, unless it is set);
codraft counts their target updates as policy versions and keeps its draft out of them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import socket
import sys
import tempfile
from pathlib import Path

from codraft.server.api import EngineControl
from codraft.server.serve_config import ServeConfig

log = logging.getLogger("codraft.serve")

VIEW_DIR = "sglang-drafts"


def sglang_view(draft: Path, work_dir: Path) -> Path:
    """A folder SGLang loads the codraft EAGLE-3 checkpoint `draft` from: its config.json in
    SGLang's tap numbering (DraftConfig.to_hf_dict(engine="sglang")) beside a link to the same
    weights file. Rewritten when the checkpoint changes (named by its weights' sha256)."""
    from codraft.draft.checkpoint import WEIGHTS_NAME, config_from_hf, sha256_file

    cfg = config_from_hf(json.loads((draft / "config.json").read_text()))
    if cfg.kind != "eagle3":
        raise ValueError(f"SGLang reads {cfg.kind} drafts as they are; {draft} needs no view")
    weights = (draft / WEIGHTS_NAME).resolve()
    out = work_dir / VIEW_DIR / f"{draft.name}-{sha256_file(weights)[:12]}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg.to_hf_dict(engine="sglang"), indent=2))
    link = out / WEIGHTS_NAME
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(weights)
    return out


def speculative_argv(draft: Path, work_dir: Path, k: int) -> list[str]:
    """SGLang's speculative arguments for the codraft draft folder `draft`: EAGLE-3 (a chain
    of `k` drafts, from SGLang's view of the checkpoint) or DFlash (its block; SGLang reads
    codraft's DFlash folder as it is)."""
    from codraft.draft.checkpoint import config_from_hf

    cfg = config_from_hf(json.loads((draft / "config.json").read_text()))
    if cfg.kind == "dflash":
        return ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path",
                str(draft), "--speculative-num-draft-tokens", str(cfg.block_size)]  # fmt: skip
    return [
        "--speculative-algorithm", "EAGLE3",
        "--speculative-draft-model-path", str(sglang_view(draft, work_dir)),
        "--speculative-num-steps", str(k), "--speculative-eagle-topk", "1",
        "--speculative-num-draft-tokens", str(k + 1),
    ]  # fmt: skip


def sglang_argv(cfg: ServeConfig, model: Path, speculative: list[str]) -> list[str]:
    """SGLang's server command line for `cfg` (cfg.vllm_args, the pass-through, last: they
    win). In "full" tap mode the radix cache is off, as vLLM's prefix caching is with the vLLM
    engine: a request whose prefix came from the cache has no features for it, and the tap
    would send none of its rows (it counts such requests incomplete)."""
    argv = [
        "--model-path", str(model), "--host", cfg.host, "--port", str(cfg.port),
        "--dtype", cfg.dtype, *speculative,
    ]  # fmt: skip
    if cfg.max_model_len is not None:
        argv += ["--context-length", str(cfg.max_model_len)]
    if cfg.tap_mode == "full" and cfg.tap_endpoint and "--disable-radix-cache" not in cfg.vllm_args:
        argv.append("--disable-radix-cache")
    return argv + list(cfg.vllm_args)


def unsupported(cfg: ServeConfig) -> list[str]:
    """What `cfg` asks of the vLLM engine that the SGLang engine does not do."""
    out = []
    if cfg.weight_transfer is not None:
        out.append("--weight-transfer (vLLM's RL weight-sync routes)")
    return out


def main(cfg: ServeConfig) -> int:
    """Run SGLang's server with codraft until it stops."""
    import importlib.util

    from codraft.server.committed import choose_draft, record_path, store_path
    from codraft.server.engine_config import ADDITIONAL_CONFIG_KEY, EngineConfig
    from codraft.server.serve_config import engine_settings, resolve_draft, resolve_model
    from codraft.server.sglang.engine import ENV, Settings

    if importlib.util.find_spec("sglang") is None:  # not imported yet: its plugins load later
        print(
            "codraft serve --engine sglang: SGLang is not installed here; it runs on GPU "
            "machines (scripts/gpu_sglang/install.sh, docs/sglang.md)",
            file=sys.stderr,
        )
        return 2
    bad = unsupported(cfg)
    if bad:
        print(f"codraft serve --engine sglang: not supported: {'; '.join(bad)}", file=sys.stderr)
        return 2
    try:
        token = cfg.resolve_token()
        cfg.check_exposure(token)
        model = resolve_model(cfg.model)
        draft = resolve_draft(cfg, model)
        if cfg.resume_draft:
            draft = choose_draft(record_path(cfg.work_dir, model), draft)
        speculative = speculative_argv(draft, Path(cfg.work_dir), cfg.num_speculative_tokens)
        codraft = EngineConfig.from_dict(engine_settings(cfg)[ADDITIONAL_CONFIG_KEY])
    except (ValueError, FileNotFoundError) as e:
        print(f"codraft serve: {e}", file=sys.stderr)
        return 2
    if token is None:
        log.warning("no control token configured: control routes are open on loopback")
    control_dir = tempfile.mkdtemp(prefix="codraft-control-")  # 0700: only this user connects
    endpoint = f"ipc://{control_dir}/engine"
    os.environ[ENV] = Settings(str(draft), endpoint, codraft).to_env()
    try:
        server_args = parse_sglang_args(sglang_argv(cfg, model, speculative))
    except SystemExit as e:  # SGLang's parser printed what it refused
        return int(e.code or 2)
    fronts = int(getattr(server_args, "tokenizer_worker_num", 1) or 1)
    http2 = bool(getattr(server_args, "enable_http2", False))
    if fronts != 1 or http2:
        print(
            f"codraft serve --engine sglang: got --tokenizer-worker-num {fronts}"
            f"{' and --enable-http2' if http2 else ''}; SGLang's multi-process HTTP front ends "
            "import a fresh app per worker, without codraft's routes: serve with one HTTP "
            "process (--tokenizer-worker-num 1, no --enable-http2)",
            file=sys.stderr,
        )
        return 2
    csock = None
    if cfg.control_port is not None:  # bound before the engine starts: a taken port fails fast
        try:
            csock = bind(cfg.effective_control_host, cfg.control_port)
        except OSError as e:
            print(f"codraft serve: control port {cfg.control_port}: {e}", file=sys.stderr)
            return 2
    run(
        cfg, server_args, token, endpoint, record_path(cfg.work_dir, model), csock,
        store_path(cfg.work_dir, model),
    )  # fmt: skip
    return 0


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (IPv6 when host is an IPv6 address)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family)


def parse_sglang_args(argv: list[str]):
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="codraft serve --engine sglang", allow_abbrev=False)
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli_args(parser.parse_args(argv))


def install_codraft(
    app,
    endpoint: str,
    token: str | None,
    settings,
    control_sock: socket.socket | None = None,
    cfg: ServeConfig | None = None,
    server_args=None,
) -> EngineControl:
    """Put /ready, /metrics, the version headers and (without `control_sock`) codraft's
    control routes in front of SGLang's app (`app`), talking to the engine in the scheduler
    over `endpoint`. With `control_sock` the control routes are served there, by a second
    server that app's lifespan runs in the same event loop (one EngineControl: one swap lock,
    one version cache for both ports), with SGLang's --ssl-keyfile/--ssl-certfile and the
    bounds of `cfg` (codraft.server.limits)."""
    from codraft.server.api import CONTROL_PATHS, EngineControl
    from codraft.server.metrics import MetricsEndpoint, sglang_registry
    from codraft.server.policy_gate import PolicyGate
    from codraft.server.serve import (
        Dispatch,
        VersionHeaders,
        allowed_control_hosts,
        build_control_app,
    )
    from codraft.server.sglang.rpc import RpcClient

    cfg = cfg or ServeConfig(engine="sglang", control_port=None if control_sock is None else 0)
    control = EngineControl(RpcClient(endpoint), settings)
    metrics = MetricsEndpoint(control, sglang_registry)
    capp = build_control_app(control, token, metrics, allowed_hosts=allowed_control_hosts(cfg))
    here = {"/ready", "/metrics"} | (set(CONTROL_PATHS) if control_sock is None else set())
    app.add_middleware(Dispatch, side=capp, paths=frozenset(here))
    app.add_middleware(VersionHeaders, control=control)
    app.add_middleware(PolicyGate, control=control, exempt=CONTROL_PATHS | SGLANG_WEIGHT_PATHS)
    app.router.lifespan_context = _lifespan(
        app.router.lifespan_context, control, capp, control_sock, cfg, server_args
    )
    return control


# SGLang's routes that mend or move the target's weights: they pass the policy gate (a broken
# policy is fixed through them as through codraft's POST /v1/policy)
SGLANG_WEIGHT_PATHS = frozenset(
    {
        "/update_weights_from_disk", "/update_weights_from_tensor",
        "/update_weights_from_distributed", "/update_weights_from_ipc",
        "/init_weights_update_group", "/destroy_weights_update_group",
        "/release_memory_occupation", "/resume_memory_occupation", "/flush_cache",
        "/get_weights_by_name", "/pause_generation", "/continue_generation",
    }
)  # fmt: skip


def _control_args(server_args) -> argparse.Namespace:
    """SGLang's TLS arguments in the names codraft.server.serve.control_server_config reads."""
    names = ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs", "ssl_cert_reqs", "ssl_ciphers")
    values = {n: getattr(server_args, n, None) for n in names}
    return argparse.Namespace(**values, uvicorn_log_level="warning")


def _lifespan(
    original,
    control: EngineControl,
    capp,
    control_sock: socket.socket | None,
    cfg: ServeConfig,
    server_args=None,
):
    """SGLang's app's lifespan with codraft's around it: the cached versions' refresher (to see
    automatic rollbacks and policy updates through SGLang's own routes) and the control
    port's server run while the app does."""
    from codraft.server.compat import no_signal_server
    from codraft.server.serve import control_server_config

    @contextlib.asynccontextmanager
    async def lifespan(app):
        control.start()
        server = task = None
        if control_sock is not None:
            config = control_server_config(capp, cfg, _control_args(server_args))
            server = no_signal_server()(config)  # SGLang's server keeps the signals
            task = asyncio.get_running_loop().create_task(server.serve(sockets=[control_sock]))
        try:
            async with original(app) as state:
                yield state
        finally:
            if server is not None:
                server.should_exit = True
                await task
            await control.stop()

    return lifespan


def engine_info(endpoint: str, timeout_s: float = 30.0) -> dict:
    """codraft_info from a thread outside the serving event loop (SGLang's warm-up thread)."""
    from codraft.server.sglang.rpc import RpcClient

    async def ask() -> dict:
        client = RpcClient(endpoint)
        try:
            return await client.call("codraft_info", timeout_s)
        finally:
            client.close()

    return asyncio.run(ask())


def run(
    cfg: ServeConfig,
    server_args,
    token: str | None,
    endpoint: str,
    record: Path,
    control_sock: socket.socket | None = None,
    store: Path | None = None,
) -> None:
    from sglang.srt.entrypoints import http_server

    from codraft.server.api import ControlSettings

    settings = ControlSettings(
        checkpoint_root=cfg.checkpoint_root,
        committed_file=str(record),
        draft_store=str(store) if store is not None else None,
    )
    control = install_codraft(
        http_server.app, endpoint, token, settings, control_sock, cfg, server_args
    )
    scheme = "https" if getattr(server_args, "ssl_certfile", None) else "http"
    where = (
        f"control on {scheme}://{cfg.effective_control_host}:{control_sock.getsockname()[1]}"
        if control_sock is not None
        else "control here"
    )

    def ready() -> None:  # SGLang's warm-up thread, once the server answers
        info = engine_info(endpoint)
        control.draft_version = (info.get("draft") or {}).get("version")
        control.policy_version = (info.get("policy") or {}).get("version")
        print(
            f"codraft serve: OpenAI API on http://{cfg.host}:{cfg.port} (SGLang engine, draft "
            f"v{control.draft_version}, {where})",
            flush=True,
        )

    http_server.launch_server(server_args, launch_callback=ready)
