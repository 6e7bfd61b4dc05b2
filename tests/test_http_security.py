"""The HTTP surface closed to strangers: the API key on every OpenAI route, the seed guard on
every body, probes and scrapes that never reach the engine, vLLM's dev mode refused,
cross-site requests to the control routes refused, TLS on the control port, and bounds that
keep idle sockets on one port from starving the other.

The OpenAI app here is vLLM's own, built in-process by vLLM's `build_app` (the builder
`codraft serve` calls) and wrapped by `codraft serve`'s own layers; its routes are read from the
app, never listed by hand. No engine runs: the engine is a stand-in that answers the codraft
RPCs (what these tests check happens before any request reaches an engine, or is the count of
RPCs sent to it). The servers are real uvicorn servers on 127.0.0.1 built by serve.py's own
config functions.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import logging
import socket
import ssl
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

KEY = "sk-test-key"
TOKEN = "control-token"
DRAFT = {"version": 3, "sha256": "a" * 64, "path": "/d", "loaded_at": "t", "tap_layers": [1]}
INFO = {"ok": True, "draft": DRAFT, "policy": {"version": 0}, "tap": {"enabled": False}}
STATS = {"ok": True, "acceptance": {"3": {"drafts": 2}}, "tap": {}, "swaps": 1}


class StandInEngine:
    """Stands in for vLLM's engine client: answers codraft's RPCs with canned replies and
    counts them (no engine is needed to see which requests would reach one)."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.replies: dict[str, Any] = {
            "codraft_info": INFO,
            "codraft_stats": STATS,
            "codraft_rollback_draft": {"ok": True, "draft": {**DRAFT, "version": 2}},
        }

    async def collective_rpc(self, method: str, timeout=None, args=(), kwargs=None):
        self.calls.append(method)
        return [self.replies[method]]

    async def check_health(self) -> None:
        return None


def _control(engine: StandInEngine) -> Any:
    from codraft.server.api import ControlSettings, EngineControl

    return EngineControl(engine, ControlSettings())


def _control_app(token: str | None = None, allowed: frozenset[str] | None = None):
    from codraft.server.metrics import MetricsEndpoint
    from codraft.server.serve import build_control_app

    engine = StandInEngine()
    control = _control(engine)
    metrics = MetricsEndpoint(control, engine_registry=lambda: None)
    return build_control_app(control, token, metrics, allowed_hosts=allowed), control, engine


# ------------------------------------------------------------------ vLLM's app, codraft's layers
@pytest.fixture(scope="module")
def openai_app():
    """vLLM's OpenAI app for `--api-key KEY`, with `codraft serve`'s layers around it."""
    from codraft.server.api import CONTROL_PATHS, add_outer_middleware
    from codraft.server.compat import serve_api
    from codraft.server.metrics import MetricsEndpoint, install_metrics
    from codraft.server.serve import Dispatch, secure_openai_app
    from codraft.server.serve_config import parse_vllm_args

    args = parse_vllm_args(["--model", "/nonexistent/model", "--api-key", KEY])
    app = serve_api().build_app(args, ("generate",), None)
    capp, control, engine = _control_app(TOKEN)
    asyncio.run(control.info())
    install_metrics(app, MetricsEndpoint(control, engine_registry=lambda: None))
    here = frozenset({"/ready", *CONTROL_PATHS})
    add_outer_middleware(app, Dispatch, side=capp, paths=here)
    secure_openai_app(app, args, seed_guard=True, control_paths=here)
    return app, here


def _operations(app: Any) -> list[tuple[str, str]]:
    """Every (method, path) the app routes, path parameters filled in; mounts as a GET below
    them."""
    from starlette.routing import Mount, Route

    out = []
    for route in app.routes:
        path = getattr(route, "path", "")
        concrete = path
        for name in getattr(route, "param_convertors", {}):
            concrete = concrete.replace("{" + name + "}", "x").replace("{" + name + ":path}", "x")
        if isinstance(route, Route):
            out += [(m, concrete) for m in sorted(route.methods or ())]
        elif isinstance(route, Mount):
            out.append(("GET", concrete.rstrip("/") + "/"))  # below the mount
    assert len(out) > 20, out
    return out


async def _send_all(app: Any, ops: list[tuple[str, str]], **kw: Any) -> dict:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    out = {}
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
        for method, path in ops:
            try:
                r = await asyncio.wait_for(c.request(method, path, **kw), 20)
                out[(method, path)] = (r.status_code, r.content[:300])
            except TimeoutError:
                out[(method, path)] = (None, b"timeout")
    return out


def test_every_openai_route_needs_the_api_key(openai_app) -> None:
    """Every method and path of vLLM's app (read from the app: /tokenize, /invocations,
    /version, /metrics, /inference/...): 401 without the key, 401 with a wrong one, not 401
    with it; /health, /ready and /metrics stay open for probes and scrapers, CORS preflights
    reach vLLM's CORS middleware; control routes want the control token."""
    app, here = openai_app
    # all but the probes, and the control routes on this port (which want the control token)
    open_paths = {"/health", "/metrics", *here}
    ops = [op for op in _operations(app) if op[1] not in open_paths]
    missing = asyncio.run(_send_all(app, ops))
    wrong = asyncio.run(_send_all(app, ops, headers={"Authorization": "Bearer nope"}))
    right = asyncio.run(_send_all(app, ops, headers={"Authorization": f"Bearer {KEY}"}))
    assert {op: s for op, (s, _) in missing.items() if s != 401} == {}
    assert {op: s for op, (s, _) in wrong.items() if s != 401} == {}
    assert all(b"API key" in body for (m, _), (_, body) in missing.items() if m != "HEAD")
    assert {op: s for op, (s, _) in right.items() if s == 401} == {}
    # probes open, control routes answer to the control token (not the API key)
    probes = asyncio.run(
        _send_all(app, [("GET", "/health"), ("GET", "/ready"), ("GET", "/metrics")])
    )
    assert probes[("GET", "/ready")][0] == probes[("GET", "/metrics")][0] == 200
    assert probes[("GET", "/health")][0] != 401
    preflight = {"Origin": "http://a.example", "Access-Control-Request-Method": "POST"}
    r = asyncio.run(_send_all(app, [("OPTIONS", "/v1/completions")], headers=preflight))
    assert r[("OPTIONS", "/v1/completions")][0] != 401  # answered by vLLM's CORS layer
    control = asyncio.run(
        _send_all(app, [("GET", "/v1/draft")], headers={"Authorization": f"Bearer {KEY}"})
    )
    assert control[("GET", "/v1/draft")][0] == 401  # the API key is not the control token
    control = asyncio.run(
        _send_all(app, [("GET", "/v1/draft")], headers={"Authorization": f"Bearer {TOKEN}"})
    )
    assert control[("GET", "/v1/draft")][0] == 200


def test_api_keys_come_from_the_flag_or_the_environment() -> None:
    from codraft.server.api_key import api_keys

    assert api_keys(argparse.Namespace(api_key=None), {"VLLM_API_KEY": "e"}) == ["e"]
    assert api_keys(argparse.Namespace(api_key=["a", "b"]), {"VLLM_API_KEY": "e"}) == ["a", "b"]
    assert api_keys(argparse.Namespace(api_key=None), {}) == []


def test_every_post_route_refuses_a_seed(openai_app) -> None:
    """A seeded body to every POST route of vLLM's app: 400 from the guard, before vLLM; a
    seed nested in sampling_params too; an unseeded body passes the guard; a body over the
    limit is 413, declared or streamed, seed or not."""
    from codraft.server.guard import MAX_INSPECT_BYTES

    app, here = openai_app
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    posts = [op for op in _operations(app) if op[0] in ("POST", "PUT", "PATCH")]
    posts = [op for op in posts if op[1] not in here]
    assert ("POST", "/invocations") in posts and ("POST", "/tokenize") in posts
    seeded = asyncio.run(_send_all(app, posts, headers=auth, content=b'{"prompt": "x", "seed": 7}'))
    assert {op: s for op, (s, _) in seeded.items() if s != 400} == {}
    assert all(b"seed" in body for _, body in seeded.values())
    nested = b'{"sampling_params": {"seed": "7"}, "token_ids": [1]}'
    r = asyncio.run(_send_all(app, [("POST", "/inference/v1/generate")], headers=auth,
                              content=nested))  # fmt: skip
    assert r[("POST", "/inference/v1/generate")][0] == 400
    plain = asyncio.run(_send_all(app, posts[:5], headers=auth, content=b'{"prompt": "x"}'))
    assert all(b"not supported by this server" not in body for _, body in plain.values())
    schema = b'{"tools": [{"parameters": {"properties": {"seed": {"type": "integer"}}}}]}'
    r = asyncio.run(_send_all(app, [("POST", "/v1/chat/completions")], headers=auth,
                              content=schema))  # fmt: skip
    assert b"not supported by this server" not in r[("POST", "/v1/chat/completions")][1]

    huge = b'{"seed": 1, "prompt": "' + b"x" * (MAX_INSPECT_BYTES + 10) + b'"}'
    r = asyncio.run(_send_all(app, [("POST", "/v1/completions")], headers=auth, content=huge))
    assert r[("POST", "/v1/completions")][0] == 413

    async def streamed():  # no Content-Length: chunked
        yield huge[: MAX_INSPECT_BYTES // 2]
        yield huge[MAX_INSPECT_BYTES // 2 :]

    r = asyncio.run(_send_all(app, [("POST", "/v1/completions")], headers=auth,
                              content=streamed()))  # fmt: skip
    assert r[("POST", "/v1/completions")][0] == 413


def test_seed_guard_reads_forms() -> None:
    from codraft.server.guard import _has_seed

    assert _has_seed(b"model=m&seed=3", b"application/x-www-form-urlencoded")
    assert not _has_seed(b"model=m", b"application/x-www-form-urlencoded")
    part = b'--b\r\nContent-Disposition: form-data; name="seed"\r\n\r\n3\r\n--b--\r\n'
    assert _has_seed(part, b"multipart/form-data; boundary=b")
    assert not _has_seed(part.replace(b'"seed"', b'"language"'), b"multipart/form-data")


# ------------------------------------------------------------------ probes from the cache
def test_ready_and_metrics_send_no_engine_rpc() -> None:
    """/ready and /metrics many times: no RPC reaches the engine; they serve what the
    refresher cached (a failing engine shows in /ready once a refresh fails)."""
    capp, control, engine = _control_app()
    rpcs: list[str] = []
    real_rpc = control.rpc

    async def counted(method: str, *a: Any, **kw: Any) -> dict:
        rpcs.append(method)
        return await real_rpc(method, *a, **kw)

    control.rpc = counted  # every RPC EngineControl sends passes here

    async def go() -> tuple[list[int], list[int], str]:
        await control.info()  # what serve() does at start
        await control.refresh_stats()  # what the refresher does
        before = len(rpcs)
        transport = httpx.ASGITransport(app=capp)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
            ready = [(await c.get("/ready")).status_code for _ in range(100)]
            metrics = [(await c.get("/metrics")) for _ in range(100)]
        assert len(rpcs) == before, rpcs[before:]
        return ready, [m.status_code for m in metrics], metrics[-1].text

    ready, metrics, text = asyncio.run(go())
    assert set(ready) == {200} and set(metrics) == {200}
    assert "codraft_draft_version 3.0" in text and 'codraft_draft_drafts_total{version="3"}' in text
    assert len(engine.calls) == 2

    # a refresh that fails makes /ready say so, still without an RPC of its own
    engine.replies["codraft_info"] = {"ok": False, "status": 503, "error": "engine gone"}

    async def failing() -> httpx.Response:
        with pytest.raises(Exception, match="engine gone"):
            await control.info()
        before = len(rpcs)
        transport = httpx.ASGITransport(app=capp)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
            r = await c.get("/ready")
        assert len(rpcs) == before
        return r

    r = asyncio.run(failing())
    assert r.status_code == 503 and r.json()["detail"] == "engine gone"


def test_refresher_keeps_the_cache_fresh() -> None:
    from codraft.server.api import ControlSettings, EngineControl

    engine = StandInEngine()
    control = EngineControl(engine, ControlSettings(refresh_s=0.01, stats_refresh_s=0.05))

    async def go() -> None:
        control.start()
        await asyncio.sleep(0.3)
        await control.stop()

    asyncio.run(go())
    assert control.last_info == INFO and control.last_stats == STATS
    assert control.stale_info() is None
    assert engine.calls.count("codraft_info") > engine.calls.count("codraft_stats") >= 2


# ------------------------------------------------------------------ dev mode
def test_vllm_dev_mode_is_refused(monkeypatch, capsys) -> None:
    from codraft.server import serve, vllm_env
    from codraft.server.serve_config import ServeConfig

    for value in ("", "0", " 0 "):
        serve.check_dev_mode({"VLLM_SERVER_DEV_MODE": value})
    serve.check_dev_mode({})
    for value in ("1", "true", "yes"):
        with pytest.raises(ValueError, match="VLLM_SERVER_DEV_MODE.*Unset"):
            serve.check_dev_mode({"VLLM_SERVER_DEV_MODE": value})
    monkeypatch.setattr(vllm_env, "apply_cpu_defaults", lambda env=None: {})
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    monkeypatch.setenv("CODRAFT_ENABLE", "1")
    assert serve.main(ServeConfig(model="/nonexistent")) == 2
    err = capsys.readouterr().err
    assert "VLLM_SERVER_DEV_MODE='1'" in err and "/collective_rpc" in err


# ------------------------------------------------------------------ cross-site
async def _browser(app: Any, method: str, path: str, headers: dict, content: bytes = b""):
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8001") as c:
        return await c.request(method, path, headers=headers, content=content)


def test_control_routes_refuse_what_a_web_page_can_send() -> None:
    """Without a token: a form POST and a text/plain fetch from another site (no preflight),
    a rebound name, a null origin: refused; the same site's JSON fetch and the codraft client
    (no Origin): served."""
    from codraft.server.serve import allowed_control_hosts
    from codraft.server.serve_config import ServeConfig

    capp, control, engine = _control_app(allowed=allowed_control_hosts(ServeConfig()))
    here = {"Host": "127.0.0.1:8001"}
    cases = [  # (headers, body, expected status)
        ({**here, "Origin": "http://evil.example",
          "Content-Type": "application/x-www-form-urlencoded"}, b"reason=x", 403),
        ({**here, "Content-Type": "application/x-www-form-urlencoded"}, b"reason=x", 415),
        ({**here, "Content-Type": "text/plain"}, b'{"reason": "x"}', 415),
        ({**here, "Content-Type": "multipart/form-data; boundary=b"}, b"--b--", 415),
        (here, b"", 415),  # a bodyless no-cors POST
        ({"Host": "evil.example:8001", "Content-Type": "application/json"}, b"{}", 403),
        ({**here, "Origin": "null", "Content-Type": "application/json"}, b"{}", 403),
        ({**here, "Origin": "http://127.0.0.1:9999", "Content-Type": "application/json"},
         b"{}", 403),
        ({**here, "Origin": "http://127.0.0.1:8001", "Content-Type": "application/json"},
         b'{"reason": "x"}', 200),
        ({**here, "Content-Type": "application/json; charset=utf-8"}, b"{}", 200),
        ({"Host": "localhost:8001", "Content-Type": "application/json"}, b"{}", 200),
        ({"Host": "[::1]:8001", "Content-Type": "application/json"}, b"{}", 200),
    ]  # fmt: skip
    got = []
    for headers, body, want in cases:
        r = asyncio.run(_browser(capp, "POST", "/v1/draft/rollback", headers, body))
        got.append((headers, r.status_code, want, r.json().get("detail", "")[:80]))
    assert [g for g in got if g[1] != g[2]] == []
    assert engine.calls.count("codraft_rollback_draft") == 4  # only the accepted ones ran
    # a rebound name can read nothing either
    r = asyncio.run(_browser(capp, "GET", "/v1/draft", {"Host": "evil.example:8001"}))
    assert r.status_code == 403 and "--control-allowed-hosts" in r.json()["detail"]
    # probes answer any Host (kubelets send the pod's address)
    r = asyncio.run(_browser(capp, "GET", "/health", {"Host": "10.1.2.3:8001"}))
    assert r.status_code == 200


def test_cross_site_with_a_token_and_allowed_hosts() -> None:
    from codraft.server.cross_site import default_allowed_hosts

    auth = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    capp, _, _ = _control_app(TOKEN)
    r = asyncio.run(_browser(capp, "GET", "/v1/draft", {**auth, "Host": "svc.ns:8001"}))
    assert r.status_code == 200  # the token protects it: any Host
    bad = {**auth, "Host": "svc.ns:8001", "Origin": "http://evil.example"}
    r = asyncio.run(_browser(capp, "POST", "/v1/draft/rollback", bad, b"{}"))
    assert r.status_code == 403
    capp, _, _ = _control_app(allowed=default_allowed_hosts("127.0.0.1", ["codraft.lan"]))
    r = asyncio.run(_browser(capp, "GET", "/v1/draft", {"Host": "codraft.lan:8001"}))
    assert r.status_code == 200
    r = asyncio.run(_browser(capp, "GET", "/v1/draft", {"Host": "other.lan:8001"}))
    assert r.status_code == 403


# ------------------------------------------------------------------ real servers
class Servers:
    """uvicorn servers in one event loop in a thread (as codraft serve runs its two)."""

    def __init__(self, configs: list[Any]) -> None:
        import uvicorn

        self.socks = []
        for _ in configs:
            s = socket.create_server(("127.0.0.1", 0), backlog=2048)
            self.socks.append(s)
        self.ports = [s.getsockname()[1] for s in self.socks]
        self.servers = [uvicorn.Server(c) for c in configs]
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        async def main() -> None:
            await asyncio.gather(
                *(srv.serve(sockets=[s]) for srv, s in zip(self.servers, self.socks, strict=True))
            )

        asyncio.run(main())

    def __enter__(self) -> Servers:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not all(s.started for s in self.servers):
            assert time.monotonic() < deadline and self.thread.is_alive(), "servers did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        for s in self.servers:
            s.should_exit = True
        self.thread.join(20)
        for s in self.socks:
            s.close()


def _self_signed(tmp: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    import ipaddress

    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_path, cert_path = tmp / "key.pem", tmp / "cert.pem"
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key_path, cert_path


def _vllm_like_args(**kw: Any) -> argparse.Namespace:
    base = dict(
        uvicorn_log_level="warning",
        disable_uvicorn_access_log=True,
        h11_max_incomplete_event_size=None,
        ssl_keyfile=None,
        ssl_certfile=None,
        ssl_ca_certs=None,
        ssl_cert_reqs=0,
        ssl_ciphers=None,
    )
    return argparse.Namespace(**{**base, **kw})


def test_control_port_serves_the_openai_ports_tls(tmp_path: Path, monkeypatch) -> None:
    """--ssl-keyfile/--ssl-certfile reach the control server: plain http fails, https with the
    CA works (httpx and CodraftClient(verify=CA), or SSL_CERT_FILE), without it fails."""
    from codraft.client.client import CodraftClient
    from codraft.client.errors import CodraftConnectionError
    from codraft.client.retry import NO_RETRY
    from codraft.learner.cli import add_arguments, online_config_from_args
    from codraft.learner.online.daemon import control_client
    from codraft.server.serve import control_server_config
    from codraft.server.serve_config import ServeConfig

    key, cert = _self_signed(tmp_path)
    capp, control, _ = _control_app(TOKEN)
    asyncio.run(control.info())
    args = _vllm_like_args(ssl_keyfile=str(key), ssl_certfile=str(cert))
    config = control_server_config(capp, ServeConfig(), args)
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    with Servers([config]) as s:
        port = s.ports[0]
        with pytest.raises(httpx.HTTPError):
            r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
            assert r.status_code == 400  # if answered at all, not served
            raise httpx.RemoteProtocolError("answered in plain http")
        assert httpx.get(f"https://127.0.0.1:{port}/health", verify=ssl.create_default_context(
            cafile=str(cert)), timeout=5).status_code == 200  # fmt: skip
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"https://127.0.0.1:{port}/health", timeout=5)  # system CAs only
        url = f"https://127.0.0.1:{port}"
        with CodraftClient(url, TOKEN, verify=str(cert), retry=NO_RETRY) as c:
            assert c.draft().version == 3
        with CodraftClient(url, TOKEN, retry=NO_RETRY) as c:
            with pytest.raises(CodraftConnectionError):
                c.draft()
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))
        with CodraftClient(url, TOKEN, retry=NO_RETRY) as c:
            assert c.draft().version == 3
        # the learner's client: `codraft learn --server https://... --server-ca CA`
        monkeypatch.delenv("SSL_CERT_FILE")
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        learn = ["--server", url, "--token", TOKEN, "--target", "t", "--out", "o"]
        cfg = online_config_from_args(parser.parse_args([*learn, "--server-ca", str(cert)]))
        with control_client(cfg) as c:
            assert c.draft().version == 3
        with control_client(online_config_from_args(parser.parse_args(learn))) as c:
            with pytest.raises(CodraftConnectionError):
                c.draft()
    with pytest.raises(ValueError, match="CA certificates"):
        CodraftClient(url, TOKEN, verify=str(tmp_path / "missing.pem"))


def test_the_learner_warns_when_its_token_would_cross_a_network_in_clear(caplog) -> None:
    from codraft.learner.online.daemon import warn_plaintext_token

    caplog.set_level(logging.WARNING, logger="codraft.learn")
    for url, token in (
        ("http://127.0.0.1:8001", TOKEN),
        ("http://localhost:8001", TOKEN),
        ("http://[::1]:8001", TOKEN),
        ("https://codraft-server-control:8001", TOKEN),
        ("http://codraft-server-control:8001", None),
    ):
        caplog.clear()
        warn_plaintext_token(url, token)
        assert not caplog.records, url
    warn_plaintext_token("http://codraft-server-control:8001", TOKEN)
    [record] = caplog.records
    assert "plain http" in record.getMessage() and TOKEN not in record.getMessage()


def _openai_stand_in() -> Any:
    from fastapi import FastAPI

    app = FastAPI()

    @app.get("/health")
    async def health() -> dict:
        return {}

    return app


def _timed_get(url: str) -> tuple[int, float]:
    t0 = time.monotonic()
    r = httpx.get(url, timeout=10)
    return r.status_code, time.monotonic() - t0


def test_idle_sockets_on_the_openai_port_starve_nothing() -> None:
    """400 sockets that send a partial request line and then nothing, on the OpenAI port:
    its /health and the control port's /health and /ready answer at once; the idle sockets
    are closed by the header timeout; each port's connection cap counts only its own."""
    import uvicorn

    from codraft.server.serve import control_server_config, openai_server_limits
    from codraft.server.serve_config import ServeConfig

    cfg = ServeConfig(header_timeout_s=2.0, control_port=0)
    args = _vllm_like_args()
    capp, control, _ = _control_app()
    asyncio.run(control.info())
    openai = uvicorn.Config(_openai_stand_in(), log_level="warning", lifespan="off",
                            timeout_keep_alive=5, **openai_server_limits(cfg, args))  # fmt: skip
    with Servers([openai, control_server_config(capp, cfg, args)]) as s:
        oport, cport = s.ports
        idle = []
        for _ in range(400):
            sock = socket.create_connection(("127.0.0.1", oport))
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            idle.append(sock)
        opened = time.monotonic()
        for url in (f"http://127.0.0.1:{oport}/health", f"http://127.0.0.1:{cport}/health",
                    f"http://127.0.0.1:{cport}/ready"):  # fmt: skip
            status, took = _timed_get(url)
            assert status == 200 and took < 2.0, (url, status, took)
        closed = 0
        for sock in idle:
            sock.settimeout(max(0.1, opened + 6 - time.monotonic()))
            try:
                closed += sock.recv(1) == b""
            except (TimeoutError, ConnectionResetError):
                pass
            sock.close()
        assert closed == 400, f"{closed} of 400 idle sockets were closed by the header timeout"
        assert time.monotonic() - opened < 8

        # a keep-alive connection that trickles the next request's headers is closed too
        sock = socket.create_connection(("127.0.0.1", oport))
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert b"200 OK" in sock.recv(4096)
        t0 = time.monotonic()
        sock.settimeout(1.0)
        gone = False
        while time.monotonic() - t0 < 6 and not gone:
            try:
                sock.sendall(b"G")
                gone = sock.recv(1) == b""
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                gone = True
        sock.close()
        assert gone and time.monotonic() - t0 < 4.5

    # the caps: the OpenAI port full (503), the control port answers
    cfg = ServeConfig(header_timeout_s=30.0, max_connections=50, control_port=0)
    openai = uvicorn.Config(_openai_stand_in(), log_level="warning", lifespan="off",
                            **openai_server_limits(cfg, args))  # fmt: skip
    with Servers([openai, control_server_config(capp, cfg, args)]) as s:
        oport, cport = s.ports
        idle = [socket.create_connection(("127.0.0.1", oport)) for _ in range(60)]
        time.sleep(0.3)
        assert _timed_get(f"http://127.0.0.1:{oport}/health")[0] == 503
        status, took = _timed_get(f"http://127.0.0.1:{cport}/ready")
        assert status == 200 and took < 2.0
        for sock in idle:
            sock.close()


def test_oversized_headers_get_431() -> None:
    import uvicorn

    from codraft.server.serve import openai_server_limits
    from codraft.server.serve_config import ServeConfig

    args = _vllm_like_args(h11_max_incomplete_event_size=8192)
    config = uvicorn.Config(_openai_stand_in(), log_level="warning", lifespan="off",
                            **openai_server_limits(ServeConfig(), args))  # fmt: skip
    with Servers([config]) as s:
        sock = socket.create_connection(("127.0.0.1", s.ports[0]))
        sock.settimeout(5)
        try:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            for _ in range(40):
                sock.sendall(b"X-Filler: " + b"a" * 1000 + b"\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        reply = b""
        try:
            while chunk := sock.recv(4096):
                reply += chunk
        except (TimeoutError, ConnectionResetError):
            pass
        sock.close()
        assert reply.startswith(b"HTTP/1.1 431"), reply[:200]


def test_serve_config_bounds() -> None:
    from codraft.server.serve_config import ServeConfig

    d = ServeConfig()
    assert (d.max_connections, d.control_max_connections, d.header_timeout_s) == (1024, 128, 10.0)
    with pytest.raises(ValueError, match="max_connections"):
        ServeConfig(max_connections=0)
    with pytest.raises(ValueError, match="header_timeout_s"):
        ServeConfig(header_timeout_s=0)
    assert json.dumps(d.control_allowed_hosts) == "[]"
