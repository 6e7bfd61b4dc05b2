"""`codraft serve`: vLLM's OpenAI-compatible server with the codraft control API, one process.

The engine is vLLM's AsyncLLM with an EAGLE-3 draft (speculative_config method "eagle3") and the
codraft worker extension (`codraft.server.worker_ext.CodraftWorkerExtension`), which captures tap
features, publishes them and swaps drafts; this module only talks to it via `collective_rpc`.

One event loop serves up to two uvicorn servers sharing the engine client:
- the OpenAI port: vLLM's own app (/v1/completions, /v1/chat/completions, streaming, n>1,
  logprobs, /health, ...) plus /ready, a /metrics that adds codraft's metrics to vLLM's, and,
  without --control-port, the control routes (dispatched around vLLM's middleware);
- the control port (--control-port): the control routes, /health, /ready, /metrics.
Both bind 127.0.0.1 unless told otherwise; control routes need the bearer token when one is
configured, and without one `codraft serve` refuses to expose them beyond loopback.

Closed to strangers:
- with vLLM's --api-key (or $VLLM_API_KEY) every path of the OpenAI port needs the key but
  /health, /ready, /metrics and the control routes (which need the control token instead):
  `codraft.server.api_key`;
- the control routes refuse foreign Host and Origin headers and non-JSON state changes
  (`codraft.server.cross_site`); /health, /ready and /metrics read cached state, never the
  engine, so probes and scrapes at any rate cost it nothing;
- the control port serves the same TLS as the OpenAI port (--ssl-keyfile, --ssl-certfile,
  --ssl-ca-certs, --ssl-cert-reqs, --ssl-ciphers);
- each port has its own connection cap (--max-connections, --control-max-connections) and a
  header-read timeout (--header-timeout-s): `codraft.server.limits`;
- VLLM_SERVER_DEV_MODE (vLLM's unauthenticated /collective_rpc, /sleep, ...) is refused.

Every /v1/completions and /v1/chat/completions response carries `X-Codraft-Draft-Version` and
`X-Codraft-Policy-Version`. A complete (non-streamed) response names the draft that was serving
when its request finished, as the engine reports it. A streamed response sends its headers
before the first token, so it names the draft loaded when the request arrived (as known to this
process: swaps through the API update it at once, automatic rollbacks within 0.5 s); a swap
during the stream is not reflected. Speculative decoding is lossless, so the tokens are the
target's whichever draft proposed them. The policy version is the one at arrival.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from codraft.server.api import (
    CONTROL_PATHS,
    ControlSettings,
    EngineControl,
    add_outer_middleware,
    document_security,
    install_control,
)
from codraft.server.api_key import OPEN_PATHS, ApiKeyGuard, api_keys
from codraft.server.committed import choose_draft, record_path, store_path
from codraft.server.cross_site import CrossSiteGuard, default_allowed_hosts
from codraft.server.guard import SeedGuard, seeded_requests_crash
from codraft.server.limits import uvicorn_limits
from codraft.server.policy_gate import PolicyGate
from codraft.server.serve_config import (
    ServeConfig,
    parse_vllm_args,
    resolve_draft,
    resolve_model,
    vllm_argv,
)
from codraft.server.weight_sync import SYNC_PATHS, install_weight_sync

log = logging.getLogger("codraft.serve")

VERSIONED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
DRAFT_HEADER = b"x-codraft-draft-version"
POLICY_HEADER = b"x-codraft-policy-version"


# ----------------------------------------------------------------------------- headers
def _engine_ids(body: bytes) -> list[str]:
    """The request ids the engine may know a finished OpenAI response by: its id, per-prompt
    `<id>-<i>` (completions) and `<id>_<i>` (chat with several prompts)."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return []
    rid = data.get("id") if isinstance(data, dict) else None
    if not isinstance(rid, str) or not rid or len(rid) > 256:
        return []
    n = min(len(data.get("choices") or []), 64)
    return [rid, *(f"{rid}-{i}" for i in range(n)), *(f"{rid}_{i}" for i in range(n))]


def _with_headers(message: Message, draft: Any, policy: Any) -> Message:
    extra = [
        (DRAFT_HEADER, b"unknown" if draft is None else str(draft).encode()),
        (POLICY_HEADER, b"unknown" if policy is None else str(policy).encode()),
    ]
    return {**message, "headers": [*message.get("headers", []), *extra]}


class VersionHeaders:
    """Adds X-Codraft-Draft-Version / X-Codraft-Policy-Version to OpenAI responses.

    Streamed responses: the versions current when the request arrived (headers precede the
    body). Complete JSON responses are held back until their body is done; then the engine is
    asked which draft was serving when the request finished (`codraft_request_versions`), and
    the arrival-time version is the fallback when it cannot tell. A client's X-Request-Id is
    made unique first (`unique_request_id`), so each response's id names one request.
    """

    def __init__(self, app: ASGIApp, control: EngineControl) -> None:
        self.app = app
        self.control = control

    @staticmethod
    def unique_request_id(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        """`headers` with a client's X-Request-Id made unique: `<its value>-<32 hex digits>`.

        vLLM takes a response's id from X-Request-Id (`cmpl-<value>`), and the engine is asked
        for the version of a response by that id: a value a client sends twice would name two
        requests, and one could be labelled with the other's draft (after a rollback, the
        higher one). Without the header vLLM's own ids are random already."""
        out, client = [], None
        for key, value in headers:
            if key.lower() == b"x-request-id":
                client = client if client is not None else value[:200]
            else:
                out.append((key, value))
        if client is not None:
            out.append((b"x-request-id", client + b"-" + uuid.uuid4().hex.encode()))
        return out

    async def _finished_version(self, body: bytes) -> int | None:
        ids = _engine_ids(body)
        if not ids:
            return None
        try:
            reply = await self.control.rpc(
                "codraft_request_versions",
                timeout=self.control.settings.probe_timeout_s,
                request_ids=ids,
            )
        except Exception as e:  # ControlError; the header then says the arrival-time version
            log.debug("codraft_request_versions failed: %s", e)
            return None
        found = [v for v in (reply.get("versions") or {}).values() if isinstance(v, int)]
        return max(found) if found else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "").removeprefix(scope.get("root_path", ""))
        if scope["type"] != "http" or path not in VERSIONED_PATHS:
            await self.app(scope, receive, send)
            return
        scope = {**scope, "headers": self.unique_request_id(list(scope.get("headers") or []))}
        draft, policy = self.control.versions()
        held: Message | None = None
        chunks: list[bytes] = []

        async def send_with_versions(message: Message) -> None:
            nonlocal held
            if message["type"] == "http.response.start":
                headers = dict(message.get("headers") or [])
                complete = headers.get(b"content-type", b"").startswith(b"application/json")
                if complete and message.get("status") == 200:
                    held = message
                    return
                await send(_with_headers(message, draft, policy))
                return
            if held is not None and message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))
                if message.get("more_body", False):
                    return
                body = b"".join(chunks)
                finished = await self._finished_version(body)
                self.control.header_sources["arrival" if finished is None else "engine"] += 1
                start, held = held, None
                await send(_with_headers(start, draft if finished is None else finished, policy))
                await send({"type": "http.response.body", "body": body, "more_body": False})
                return
            await send(message)

        await self.app(scope, receive, send_with_versions)


# ----------------------------------------------------------------------------- apps
def build_control_app(
    control: EngineControl,
    token: str | None,
    metrics: Any,
    weight_transfer: str | None = None,
    allowed_hosts: frozenset[str] | None = None,
) -> Any:
    """The control routes, /health, /ready and /metrics (and with `weight_transfer`, vLLM's RL
    weight-sync routes): served on --control-port, or reached through `Dispatch` on the OpenAI
    port. The routes refuse cross-site requests (`CrossSiteGuard`; Host names: `allowed_hosts`,
    default the loopback ones)."""
    from fastapi import FastAPI

    from codraft.server.metrics import install_metrics

    app = FastAPI(title="codraft control", docs_url=None, redoc_url=None)  # /openapi.json
    install_control(app, control, token, probes=("/health", "/ready"))
    if weight_transfer is not None:
        install_weight_sync(app, control, token, weight_transfer)
    install_metrics(app, metrics)
    guarded = set(CONTROL_PATHS) | (set(SYNC_PATHS) if weight_transfer else set())
    app.add_middleware(
        CrossSiteGuard,
        paths=guarded,
        allowed_hosts=allowed_hosts or default_allowed_hosts("127.0.0.1"),
        token_set=token is not None,
    )
    document_security(app, token, extra_paths=SYNC_PATHS if weight_transfer else ())
    return app


class Dispatch:
    """Requests for `paths` go to `side` (the control app), all others to `app` (vLLM's).

    The control routes thus never pass through vLLM's middleware: its --api-key check (which
    guards every /v1 path and would want a second bearer token), CORS, request logging.
    """

    def __init__(self, app: ASGIApp, side: ASGIApp, paths: frozenset[str]) -> None:
        self.app = app
        self.side = side
        self.paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "").removeprefix(scope.get("root_path", ""))
        target = self.side if scope["type"] == "http" and path in self.paths else self.app
        await target(scope, receive, send)


def secure_openai_app(
    app: Any, args: argparse.Namespace, *, seed_guard: bool, control_paths: frozenset[str]
) -> None:
    """The outermost layers of the OpenAI port: the seed guard (`codraft.server.guard`, every
    request with a body but those to `control_paths`, which the control app serves) and, with
    an API key configured, the key on every path but /health, /ready, /metrics and
    `control_paths`
    (`codraft.server.api_key`)."""
    add_outer_middleware(app, SeedGuard, enabled=seed_guard, skip_paths=control_paths)
    keys = api_keys(args)
    if keys:
        add_outer_middleware(app, ApiKeyGuard, keys=keys, open_paths=OPEN_PATHS | control_paths)


DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"


def check_dev_mode(environ: dict[str, str] | os._Environ[str]) -> None:
    """Refuse vLLM's development mode: it adds /collective_rpc, /sleep, /reset_mm_cache and
    more, answering anyone (no API key, no control token)."""
    value = environ.get(DEV_MODE_ENV, "").strip()
    if value not in ("", "0"):
        raise ValueError(
            f"{DEV_MODE_ENV}={value!r}: vLLM's development mode serves unauthenticated routes "
            "that run code in the engine (/collective_rpc) and put it to sleep; codraft serve "
            f"refuses it. Unset {DEV_MODE_ENV} (or set it to 0); codraft's control routes "
            "and --weight-transfer's do what it is used for, behind the control token"
        )


def ssl_settings(args: argparse.Namespace) -> dict[str, Any]:
    """uvicorn.Config's TLS keywords from vLLM's --ssl-* arguments (empty without a key)."""
    if not getattr(args, "ssl_keyfile", None) or not getattr(args, "ssl_certfile", None):
        return {}
    out: dict[str, Any] = {"ssl_keyfile": args.ssl_keyfile, "ssl_certfile": args.ssl_certfile}
    for name in ("ssl_ca_certs", "ssl_cert_reqs", "ssl_ciphers"):
        if getattr(args, name, None) is not None:
            out[name] = getattr(args, name)
    return out


def _max_header_bytes(args: argparse.Namespace) -> int:
    """vLLM's --h11-max-incomplete-event-size, or its default (4 MiB)."""
    given = getattr(args, "h11_max_incomplete_event_size", None)
    return int(given) if given else 4 << 20


def openai_server_limits(cfg: ServeConfig, args: argparse.Namespace) -> dict[str, Any]:
    """The OpenAI port's uvicorn keywords for its bounds (`codraft.server.limits`)."""
    return uvicorn_limits(cfg.max_connections, cfg.header_timeout_s, _max_header_bytes(args))


def control_server_config(
    capp: Any, cfg: ServeConfig, args: argparse.Namespace, keep_alive_s: int = 5
) -> Any:
    """The control port's uvicorn.Config: the OpenAI port's TLS, a connection cap and a header
    timeout of its own."""
    import uvicorn

    return uvicorn.Config(
        capp,
        log_level=getattr(args, "uvicorn_log_level", "info"),
        access_log=not getattr(args, "disable_uvicorn_access_log", False),
        lifespan="off",
        timeout_keep_alive=keep_alive_s,
        h11_max_incomplete_event_size=_max_header_bytes(args),
        **uvicorn_limits(cfg.control_max_connections, cfg.header_timeout_s,
                         _max_header_bytes(args)),
        **ssl_settings(args),
    )  # fmt: skip


def allowed_control_hosts(cfg: ServeConfig) -> frozenset[str]:
    """The Host names the control routes answer without a token: the address they are bound
    to, the loopback names and --control-allowed-hosts."""
    bound = cfg.effective_control_host if cfg.control_port is not None else cfg.host
    return default_allowed_hosts(bound, cfg.control_allowed_hosts)


class EngineSideError(RuntimeError):
    """The engine runs but its codraft worker extension does not answer."""


async def _check_engine_side(control: EngineControl, cfg: ServeConfig) -> None:
    """The first codraft RPC: installs the worker extension's hooks and checks they answer."""
    from codraft.server.auth import ControlError

    try:
        info = await control.info()
    except ControlError as e:
        raise EngineSideError(
            f"the engine does not answer codraft_info ({e.message}); codraft serve needs the "
            f"worker extension {cfg.worker_extension_cls!r} importable in the engine process"
        ) from e
    control.draft_version = (info.get("draft") or {}).get("version")
    control.policy_version = (info.get("policy") or {}).get("version")
    log.info("codraft engine side: %s", info)


async def serve(cfg: ServeConfig, args: argparse.Namespace, token: str | None) -> None:
    from codraft.server.compat import serve_api
    from codraft.server.metrics import MetricsEndpoint, install_metrics

    api = serve_api()  # where this vLLM release keeps its OpenAI server's pieces
    envs = api.envs

    def interrupt_startup(*_: object) -> None:
        raise KeyboardInterrupt("terminated")

    signal.signal(signal.SIGTERM, interrupt_startup)  # serve_http installs its own later
    # Bind both ports before the engine starts, so a taken port fails fast.
    listen_address, sock = api.setup_server(args, reuse_port=False)
    csock = None
    if cfg.control_port is not None:
        caddr = (cfg.effective_control_host, cfg.control_port)
        csock = api.create_server_socket(caddr, reuse_port=False)
    control_server = control_task = None
    async with api.build_async_engine_client(args) as engine:
        settings = ControlSettings(
            checkpoint_root=cfg.checkpoint_root,
            committed_file=str(record_path(cfg.work_dir, Path(args.model))),
            draft_store=str(store_path(cfg.work_dir, Path(args.model))),
        )
        control = EngineControl(engine, settings)
        await _check_engine_side(control, cfg)
        metrics = MetricsEndpoint(control)

        tasks = await engine.get_supported_tasks()
        app = api.build_app(args, tasks, engine.model_config)
        await api.init_app_state(engine, app.state, args, tasks)
        capp = build_control_app(
            control, token, metrics, cfg.weight_transfer, allowed_control_hosts(cfg)
        )
        # The OpenAI port: vLLM's app with codraft's /metrics, /ready and, without a control
        # port, the control routes (and the weight-sync ones); the version headers around it.
        install_metrics(app, metrics)
        routes = set(CONTROL_PATHS) | (set(SYNC_PATHS) if cfg.weight_transfer else set())
        here = {"/ready"} | (routes if csock is None else set())
        add_outer_middleware(app, Dispatch, side=capp, paths=frozenset(here))
        add_outer_middleware(app, VersionHeaders, control=control)
        add_outer_middleware(app, PolicyGate, control=control, exempt=CONTROL_PATHS | SYNC_PATHS)
        secure_openai_app(
            app, args, seed_guard=seeded_requests_crash(), control_paths=frozenset(here)
        )

        if csock is not None:
            config = control_server_config(capp, cfg, args, envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE)
            control_server = api.NoSignalServer(config)
            control_task = asyncio.get_running_loop().create_task(
                control_server.serve(sockets=[csock])
            )
        control.start()
        tls = bool(ssl_settings(args))
        chost = cfg.effective_control_host
        where = f"control on {_url(chost, csock, tls)}" if csock else "control here"
        print(f"codraft serve: OpenAI API on {listen_address} ({where})", flush=True)
        serving = asyncio.get_running_loop().create_task(
            api.serve_http(
                app,
                sock=sock,
                enable_ssl_refresh=args.enable_ssl_refresh,
                host=args.host,
                port=args.port,
                log_level=args.uvicorn_log_level,
                access_log=not args.disable_uvicorn_access_log,
                timeout_keep_alive=envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE,
                ssl_keyfile=args.ssl_keyfile,
                ssl_certfile=args.ssl_certfile,
                ssl_ca_certs=args.ssl_ca_certs,
                ssl_cert_reqs=args.ssl_cert_reqs,
                ssl_ciphers=args.ssl_ciphers,
                h11_max_incomplete_event_size=args.h11_max_incomplete_event_size,
                h11_max_header_count=args.h11_max_header_count,
                **openai_server_limits(cfg, args),
            )
        )
        await asyncio.sleep(0)  # serve_http installs its SIGINT/SIGTERM handlers, then waits
        _mark_draining_on_sigterm(control)
        shutdown = await serving
        await control.stop()
        if control_server is not None:
            control_server.should_exit = True
    try:
        await shutdown
        if control_task is not None:
            await control_task
    finally:
        sock.close()
        if csock is not None:
            csock.close()


def _mark_draining_on_sigterm(control: EngineControl) -> None:
    """On SIGTERM, make /ready answer 503 first, then shut down as vLLM does on SIGINT (its
    handler for both: stop the engine, draining requests for --shutdown-timeout seconds)."""

    def on_term() -> None:
        control.draining = True
        control.stop_refreshing()  # the engine refuses RPCs while it drains
        os.kill(os.getpid(), signal.SIGINT)

    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, on_term)


def _url(host: str, sock: Any, tls: bool = False) -> str:
    port, scheme = sock.getsockname()[1], "https" if tls else "http"
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def main(cfg: ServeConfig) -> int:
    """Run `codraft serve` until SIGINT/SIGTERM. Call `ensure_cpu_preload()` before this."""
    from codraft.server.vllm_env import apply_cpu_defaults

    apply_cpu_defaults()
    os.environ.setdefault("CODRAFT_ENABLE", "1")  # codraft.server.plugin checks the vLLM version
    try:
        check_dev_mode(os.environ)
        token = cfg.resolve_token()
        cfg.check_exposure(token)
        if token is None:
            log.warning("no control token configured: control routes are open on loopback")
        model = resolve_model(cfg.model)
        draft = resolve_draft(cfg, model)
        if cfg.resume_draft:
            draft = choose_draft(record_path(cfg.work_dir, model), draft)
    except (ValueError, FileNotFoundError) as e:
        print(f"codraft serve: {e}", file=sys.stderr)
        return 2
    try:
        argv = vllm_argv(cfg, model, draft)
    except ValueError as e:
        print(f"codraft serve: {e}", file=sys.stderr)
        return 2
    args = parse_vllm_args(argv)
    import uvloop

    try:
        uvloop.run(serve(cfg, args, token))
    except KeyboardInterrupt:
        pass
    except EngineSideError as e:
        print(f"codraft serve: {e}", file=sys.stderr)
        return 1
    return 0


# ----------------------------------------------------------------------------- subprocess
def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (for tests and benchmarks)."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServeProcess:
    """`codraft serve` in a child process on 127.0.0.1 (tests, benchmarks, demos).

    `start` picks free ports, `wait_ready` polls /ready until the engine serves with a draft,
    `stop` sends SIGTERM (then SIGKILL after `timeout`). With `tls_ca` (the CA file that signed
    the --ssl-certfile in `argv`) both ports are reached over https, trusting that CA."""

    def __init__(
        self,
        argv: list[str],
        log_path: Path,
        *,
        control: bool,
        env: dict | None,
        tls_ca: str | None = None,
    ):
        import subprocess

        from codraft.server.vllm_env import preload_env

        self.port = free_port()
        self.control_port = free_port() if control else None
        self.tls_ca = tls_ca
        self.scheme = "https" if tls_ca else "http"
        ports = ["--port", str(self.port)]
        if self.control_port is not None:
            ports += ["--control-port", str(self.control_port)]
        self.log_path = Path(log_path)
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "codraft.cli", "serve", *ports, *argv],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=preload_env(env),
        )

    @classmethod
    def start(
        cls,
        argv: list[str],
        log_path: Path,
        *,
        control: bool = True,
        env: dict | None = None,
        tls_ca: str | None = None,
    ) -> ServeProcess:
        return cls(argv, log_path, control=control, env=env, tls_ca=tls_ca)

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    @property
    def control_url(self) -> str:
        port = self.control_port if self.control_port is not None else self.port
        return f"{self.scheme}://127.0.0.1:{port}"

    @property
    def verify(self) -> Any:
        """What httpx's `verify` takes to trust this server (True without TLS)."""
        import ssl

        return ssl.create_default_context(cafile=self.tls_ca) if self.tls_ca else True

    def log_tail(self, chars: int = 6000) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_bytes()[-chars:].decode(errors="replace")

    def wait_ready(self, timeout: float = 300.0) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"codraft serve exited with {self.proc.returncode}; log:\n{self.log_tail()}"
                )
            try:
                ready = httpx.get(f"{self.control_url}/ready", timeout=2.0, verify=self.verify)
                if ready.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        tail = self.log_tail()
        raise TimeoutError(f"codraft serve not ready after {timeout:.0f} s; log:\n{tail}")

    def stop(self, timeout: float = 60.0) -> int | None:
        import subprocess

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self._log.close()
        return self.proc.returncode
