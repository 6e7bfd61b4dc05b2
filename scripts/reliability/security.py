"""Security, measured on the running processes: every control route without and with a wrong
token, every route of the OpenAI port (as its own /openapi.json lists them) without and with a
wrong API key, requests a web page could send, the probes while hundreds of idle sockets hold the
OpenAI port, what listens where, which request sizes are refused, and where pickle could reach
the network."""

from __future__ import annotations

import ast
import re
import socket
import time
from pathlib import Path

import httpx

from codraft.draft.checkpoint import MAX_HEADER_BYTES
from codraft.server.api import CONTROL_PATHS, ControlSettings
from codraft.tap import DEFAULT_LIMITS
from codraft.testing import descendants

from .stack import API_KEY, TOKEN, Stack

ROUTES = [
    ("GET", "/v1/draft", None),
    ("POST", "/v1/draft", {"version": 1, "path": "/x"}),
    ("GET", "/v1/draft/prepare", None),
    ("POST", "/v1/draft/prepare", {"path": "/x"}),
    ("POST", "/v1/draft/rollback", {}),
    ("POST", "/v1/policy", {"version": 1, "path": "/x"}),
    ("GET", "/v1/tap", None),
    ("PUT", "/v1/tap", {"enabled": False}),
    ("GET", "/v1/draft/digest", None),
    ("GET", "/v1/stats", None),
]
OPEN = {"/health", "/ready", "/metrics"}  # probes and scrapers carry no credentials


def control_auth(stack: Stack) -> list[dict]:
    assert {p for _, p, _ in ROUTES} == set(CONTROL_PATHS), "a control route is not checked"
    rows = []
    with httpx.Client(base_url=stack.control_url, timeout=30) as c:
        for method, path, body in ROUTES:
            row = {"route": f"{method} {path}"}
            for name, headers in (
                ("no token", {}),
                ("wrong token", {"Authorization": "Bearer x" + TOKEN}),
            ):
                r = c.request(method, path, json=body, headers=headers)
                row[name] = r.status_code
                row[f"{name} challenge"] = r.headers.get("www-authenticate", "")
            rows.append(row)
    return rows


def openai_auth(stack: Stack) -> list[dict]:
    """Every path and method of the OpenAI port's own schema, without and with a wrong key
    (401 expected but on the probes), and the three main routes with the right key (200)."""
    key = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": str(stack.model), "prompt": "Hi", "max_tokens": 2}
    chat = {
        "model": str(stack.model),
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 2,
    }
    good = {"/v1/models": None, "/v1/completions": body, "/v1/chat/completions": chat}
    rows = []
    with httpx.Client(base_url=stack.url, timeout=120) as c:
        schema = c.get("/openapi.json", headers=key).json()
        for path, ops in sorted(schema["paths"].items()):
            concrete = re.sub(r"\{[^}]+\}", "x", path)
            for method in sorted(m.upper() for m in ops if m in ("get", "post", "put", "delete")):
                row = {"route": f"{method} {path}"}
                for name, headers in (("no key", {}), ("wrong key", {"Authorization": "Bearer x"})):
                    r = c.request(method, concrete, json={} if method != "GET" else None,
                                  headers=headers)  # fmt: skip
                    row[name] = r.status_code
                if path in good:
                    row["right key"] = c.request(
                        method, path, json=good[path], headers=key
                    ).status_code
                row["open"] = path in OPEN
                rows.append(row)
    return rows


def cross_site(stack: Stack) -> list[dict]:
    """What a web page in a browser on this machine can send to the control port: a simple form
    POST (text/plain, no preflight) and a JSON POST from another origin, even with the token
    (a page that somehow holds it), and a form POST without it."""
    evil, auth = {"Origin": "http://evil.example"}, {"Authorization": f"Bearer {TOKEN}"}
    sends = (
        ("form POST from another origin", {**evil, **auth, "Content-Type": "text/plain"}),
        ("JSON POST from another origin", {**evil, **auth, "Content-Type": "application/json"}),
        ("form POST, same origin, no token", {"Content-Type": "text/plain"}),
    )
    url = f"{stack.control_url}/v1/draft/rollback"
    return [
        {
            "request": name,
            "status": httpx.post(url, content=b"{}", headers=h, timeout=30).status_code,
        }
        for name, h in sends
    ]


def idle_sockets(stack: Stack, n: int = 300, hold_s: float = 3.0) -> dict:
    """`n` connections to the OpenAI port that send half a request line and then nothing
    (slowloris); meanwhile the control port's probes and a control route must still answer."""
    host, port = stack.url.rsplit("//", 1)[1].rsplit(":", 1)
    held = []
    for _ in range(n):
        s = socket.create_connection((host, int(port)), timeout=5)
        s.sendall(b"GET /v1/models HT")
        held.append(s)
    t0 = time.monotonic()
    answers = {}
    while time.monotonic() - t0 < hold_s:
        for path in ("/health", "/ready", "/v1/draft"):
            t = time.monotonic()
            r = httpx.get(f"{stack.control_url}{path}", timeout=30,
                          headers={"Authorization": f"Bearer {TOKEN}"})  # fmt: skip
            a = answers.setdefault(path, {"answered": 0, "status": set(), "slowest_s": 0.0})
            a["answered"] += 1
            a["status"].add(r.status_code)
            a["slowest_s"] = max(a["slowest_s"], time.monotonic() - t)
    closed = 0
    for s in held:  # the header timeout closes them from the server's side
        s.settimeout(30)
        try:
            closed += s.recv(1) == b""
        except OSError:
            closed += 1
        s.close()
    return {
        "idle_sockets": n,
        "closed_by_the_server": closed,
        "during": {p: {**a, "status": sorted(a["status"])} for p, a in answers.items()},
    }


def probes(stack: Stack) -> dict[str, int]:
    out = {}
    for base, path in (
        (stack.control_url, "/health"),
        (stack.control_url, "/ready"),
        (stack.control_url, "/metrics"),
        (stack.url, "/metrics"),
        (stack.url, "/ready"),
        (stack.control_url, "/openapi.json"),
    ):
        out[f"{base.rsplit(':', 1)[1]}{path}"] = httpx.get(base + path, timeout=30).status_code
    return out


def _inodes(pid: int) -> set[str]:
    found = set()
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = str(fd.readlink())
            except OSError:
                continue
            if target.startswith("socket:["):
                found.add(target[8:-1])
    except OSError:
        pass
    return found


def _address(hexaddr: str, v6: bool) -> str:
    host, port = hexaddr.split(":")
    raw = bytes.fromhex(host)
    if v6:
        raw = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
        return f"[{socket.inet_ntop(socket.AF_INET6, raw)}]:{int(port, 16)}"
    return f"{socket.inet_ntop(socket.AF_INET, raw[::-1])}:{int(port, 16)}"


def listening(stack: Stack) -> list[dict]:
    """Every listening TCP socket of the server's and the learner's process trees."""
    owners: dict[str, str] = {}
    for name, proc in (("serve", stack.server), ("learn", stack.learner)):
        if proc is None:
            continue
        for pid in [proc.pid, *descendants(proc.pid)]:
            comm = (
                Path(f"/proc/{pid}/comm").read_text().strip()
                if Path(f"/proc/{pid}/comm").exists()
                else "?"
            )
            for inode in _inodes(pid):
                owners[inode] = f"{name} ({comm})"
    rows = []
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in owners:  # LISTEN
                address = _address(f[1], v6)
                loopback = address.startswith(("127.", "[::1]"))
                rows.append({"owner": owners[f[9]], "address": address, "loopback": loopback})
    return sorted(rows, key=lambda r: (r["owner"], r["address"]))


def size_limits(stack: Stack) -> list[dict]:
    """What each entry point refuses, measured where it is cheap to send."""
    settings = ControlSettings()
    auth = {"Authorization": f"Bearer {TOKEN}"}
    rows = []
    big = b'{"version": 1, "path": "' + b"a" * (settings.max_body_bytes + 1) + b'"}'
    r = httpx.post(
        f"{stack.control_url}/v1/draft",
        content=big,
        headers={**auth, "Content-Type": "application/json"},
        timeout=30,
    )
    rows.append(
        {
            "entry": "control request body",
            "limit": f"{settings.max_body_bytes} bytes",
            "measured": f"{len(big)} bytes: HTTP {r.status_code}",
        }
    )
    r = httpx.post(
        f"{stack.url}/v1/completions",
        headers={"Authorization": f"Bearer {API_KEY}"},
        json={"model": str(stack.model), "prompt": "word " * 1100, "max_tokens": 4},
        timeout=60,
    )
    rows.append(
        {
            "entry": "OpenAI prompt",
            "limit": "--max-model-len tokens (1024 here)",
            "measured": f"~1,100 tokens: HTTP {r.status_code}",
        }
    )
    tap = DEFAULT_LIMITS
    rows += [
        {
            "entry": "tap message (learner)",
            "limit": f"{tap.max_message_bytes} bytes (ZeroMQ MAXMSGSIZE: a larger frame resets "
            f"the sender's connection), header {tap.max_header_bytes} bytes, {tap.max_tokens} "
            f"tokens, {tap.max_tap_layers} tap layers, hidden size {tap.max_hidden_size}, ids "
            f"{tap.max_id_chars} characters",
            "measured": "see taps: the 'size' and 'header' refusals",
        },
        {
            "entry": "draft checkpoint header",
            "limit": f"{MAX_HEADER_BYTES} bytes",
            "measured": "see checkpoints: 'oversized safetensors header'",
        },
        {
            "entry": "control JSON fields",
            "limit": "paths 4096 characters, reasons 200, versions 0..2**53-1, no unknown fields",
            "measured": "see fuzz",
        },
    ]
    return rows


NETWORK_CODE = ("server", "learner/online", "client", "codraft/tap", "codraft/control_token.py")


def pickle_scan(repo: Path) -> dict:
    """Modules on a network path that import pickle/marshal/dill/shelve, or call torch.load
    without weights_only=True (parsed, not grepped)."""
    findings = []
    for part in NETWORK_CODE:
        base = repo / part
        for file in [base] if base.is_file() else sorted(base.rglob("*.py")):
            tree = ast.parse(file.read_text())
            for node in ast.walk(tree):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module]
                for n in names:
                    if n.split(".")[0] in ("pickle", "marshal", "dill", "shelve", "cloudpickle"):
                        findings.append(f"{file.relative_to(repo)}:{node.lineno} imports {n}")
                if (
                    isinstance(node, ast.Call)
                    and getattr(node.func, "attr", "") == "load"
                    and getattr(node.func.value, "id", "") == "torch"
                ):
                    safe = any(
                        k.arg == "weights_only" and getattr(k.value, "value", None) is True
                        for k in node.keywords
                    )
                    if not safe:
                        where = f"{file.relative_to(repo)}:{node.lineno}"
                        findings.append(f"{where} torch.load without weights_only=True")
    return {"scanned": list(NETWORK_CODE), "findings": findings}


def run(stack: Stack, repo: Path) -> dict:
    control = control_auth(stack)
    openai = openai_auth(stack)
    sockets = listening(stack)
    sites = cross_site(stack)
    slow = idle_sockets(stack)
    return {
        "control_routes": control,
        "control_all_401": all(r["no token"] == r["wrong token"] == 401 for r in control),
        "openai_routes": openai,
        "openai_key_enforced": all(
            (r["no key"] == r["wrong key"] == 401) != r["open"] and r.get("right key", 200) == 200
            for r in openai
        ),
        "cross_site": sites,
        "cross_site_refused": all(r["status"] in (401, 403, 415) for r in sites),
        "slowloris": slow,
        "probes_answered_under_slowloris": all(
            a["status"] == [200] for a in slow["during"].values()
        ),
        "probes": probes(stack),
        "listening": sockets,
        "all_loopback": all(s["loopback"] for s in sockets),
        "size_limits": size_limits(stack),
        "pickle": pickle_scan(repo),
    }
