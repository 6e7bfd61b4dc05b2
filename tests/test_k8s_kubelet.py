"""The cpu-demo overlay as its kubelet sees it: each pod in a network namespace of its own.

The overlay is rendered by kustomize and each container's command runs as rendered: its args
after $(VAR) expansion, its env from the ConfigMap, the Secrets and its resource limits, its
volumes as folders (a PersistentVolumeClaim is one folder every pod that claims it shares; an
emptyDir one per pod; a Secret its items as files). Each pod has its own address on a bridge,
its own loopback and hostname, and an /etc/hosts in which the Services' DNS names resolve to
the pods behind them (tests/netns.py). The probes are sent from the root namespace, the node, to
the pod's address, as the kubelet sends them: a server that listens on 127.0.0.1 only is
unreachable there, and the test fails.

What is changed, and why: `tini --` is dropped (PID 1 reaping is not under test), `codraft` and
`torchrun` run from this checkout's interpreter, the image's model folder is a tiny random
Llama, a few flags size the run for two CPU cores (eager mode, a small buffer and token budget,
frequent publishes), and processes run as root (the pod security context is checked offline by
tests/test_k8s.py). A ClusterIP Service with one pod behind it resolves straight to that pod
(no virtual IP). NetworkPolicies are checked offline (k8s/wiring.py); nothing here enforces
them.

Checked: every pod's startup, readiness and liveness probes pass from the node; an OpenAI client
in a pod of its own completes requests through the Service name; the learner's drafts reach the
server over this network and are installed; every Service port answers on its pod's address.
A learner started without the rendered `--http-host` (its old default) fails the probe from
the node while answering on its own loopback: the mutation that the first check must catch.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from netns import Node, Pod, available
from test_k8s import manifests, pod, render

from codraft.testing import kill_tree

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not available(), reason="needs root and iproute2 for network namespaces"),
]

OVERLAY = "cpu-demo"
NAMESPACE = "codraft"
IMAGE_MODEL = "/opt/codraft/models/smollm2"  # where the CPU images carry the model
SERVER_EXTRA = ["--enforce-eager"]
LEARNER_EXTRA = [
    "--device=cpu", "--publish-every=8", "--min-buffer-tokens=200", "--token-budget=256",
    "--lr=3e-3", "--max-seconds=600",
]  # fmt: skip
STARTUP_S = 420  # the rendered startup budgets are longer (15 and 10 minutes)
PUBLISH_S = 420


# ----------------------------------------------------------------------------- the pods
def _secret_values(objs: list[dict], made: dict[str, dict[str, str]]) -> dict[str, dict]:
    """Every Secret the overlay's pods name, with values made here (never in the manifests)."""
    names = set()
    for w in manifests.workloads(objs):
        spec = manifests.pod_spec(w)
        names |= {v["secret"]["secretName"] for v in spec.get("volumes", []) if "secret" in v}
        for c in spec["containers"]:
            names |= {
                e["valueFrom"]["secretKeyRef"]["name"]
                for e in c.get("env", [])
                if "secretKeyRef" in e.get("valueFrom", {})
            }
    missing = names - set(made)
    assert not missing, f"the overlay names Secrets this test does not make: {sorted(missing)}"
    return {n: made[n] for n in names}


def _volumes(spec: dict, c: dict, root: Path, pod_name: str, secret: dict) -> dict[str, Path]:
    """mountPath -> the folder that stands for the volume."""
    vols = {v["name"]: v for v in spec.get("volumes", [])}
    out: dict[str, Path] = {}
    for m in c.get("volumeMounts", []):
        v = vols[m["name"]]
        if "persistentVolumeClaim" in v:
            folder = root / "pvc" / v["persistentVolumeClaim"]["claimName"]
        elif "secret" in v:
            name = v["secret"]["secretName"]
            folder = root / "pods" / pod_name / "secrets" / name
            folder.mkdir(parents=True, exist_ok=True)
            items = v["secret"].get("items") or [{"key": k, "path": k} for k in secret[name]]
            for item in items:
                (folder / item["path"]).parent.mkdir(parents=True, exist_ok=True)
                (folder / item["path"]).write_text(secret[name][item["key"]])
        elif "emptyDir" in v:
            folder = root / "pods" / pod_name / m["name"]
        else:
            raise AssertionError(f"volume {m['name']}: a kind this test does not stand in for")
        folder.mkdir(parents=True, exist_ok=True)
        out[m["mountPath"]] = folder
    return out


def _rewrite(text: str, paths: dict[str, Path]) -> str:
    """Each path under a mount (or the image's model) replaced by its folder, in one pass."""
    alternatives = "|".join(re.escape(p) for p in sorted(paths, key=len, reverse=True))
    pattern = rf"(?<![\w/])({alternatives})(?=/|$|[,:\s])"
    return re.sub(pattern, lambda m: str(paths[m.group(1)]), text)


def _env(objs: list[dict], c: dict, secret: dict) -> dict[str, str]:
    env: dict[str, str] = {}
    for src in c.get("envFrom", []):
        env.update(manifests.find(objs, "ConfigMap", src["configMapRef"]["name"]).get("data", {}))
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
            continue
        ref = e["valueFrom"]
        if "secretKeyRef" in ref:
            env[e["name"]] = secret[ref["secretKeyRef"]["name"]][ref["secretKeyRef"]["key"]]
        elif "resourceFieldRef" in ref:
            kind, what = ref["resourceFieldRef"]["resource"].split(".")
            env[e["name"]] = str(c["resources"][kind][what])
        else:
            raise AssertionError(f"env {e['name']}: a source this test does not stand in for")
    return env


def pod_argv(objs: list[dict], kind: str, name: str, paths: dict[str, Path]) -> list[str]:
    """The container's command as rendered, with this machine's interpreter and folders."""
    args = manifests.argv(objs, pod(objs, kind, name)["containers"][0])
    if args[:2] == ["tini", "--"]:
        args = args[2:]
    program = {"codraft": ["-m", "codraft.cli"], "torchrun": ["-m", "torch.distributed.run"]}
    return [sys.executable, *program[args[0]], *(_rewrite(a, paths) for a in args[1:])]


def service_names(objs: list[dict], pods: dict[str, Pod]) -> dict[str, str]:
    """Cluster DNS for one pod per workload: a Service's name (short, namespaced and fully
    qualified) resolves to the pod behind it; a StatefulSet's pods also by `pod.service`."""
    names: dict[str, str] = {}
    workloads = {manifests.name_of(w).split("/")[-1]: w for w in manifests.workloads(objs)}

    def add(name: str, ip: str) -> None:
        for n in (name, f"{name}.{NAMESPACE}", f"{name}.{NAMESPACE}.svc",
                  f"{name}.{NAMESPACE}.svc.cluster.local"):  # fmt: skip
            names[n] = ip

    for svc in (o for o in objs if o["kind"] == "Service"):
        svc_name = svc["metadata"]["name"]
        for wname, w in workloads.items():
            behind = manifests.selects(svc["spec"]["selector"], manifests.pod_labels(w))
            if wname not in pods or not behind:
                continue
            add(svc_name, pods[wname].ip)
            if w["kind"] == "StatefulSet" and w["spec"].get("serviceName") == svc_name:
                add(f"{pods[wname].name}.{svc_name}", pods[wname].ip)
    return names


def probe_port(c: dict, port: int | str) -> int:
    number = manifests.port_number(c, port)
    assert number is not None, f"probe port {port!r} is no port of {c['name']}"
    return number


def kubelet_probe(pod: Pod, c: dict, which: str) -> tuple[bool, str]:
    """One probe as the kubelet sends it: from the node, to the pod's address."""
    get = c[which]["httpGet"]
    url = f"http://{pod.ip}:{probe_port(c, get['port'])}{get['path']}"
    try:
        r = httpx.get(url, timeout=c[which].get("timeoutSeconds", 1))
    except httpx.HTTPError as e:
        return False, f"{url}: {type(e).__name__}: {e}"
    return 200 <= r.status_code < 400, f"{url}: {r.status_code} {r.text[:200]}"


@contextmanager
def cluster(tmp: Path, pod_names: list[str]) -> Iterator[tuple[Node, dict[str, Pod]]]:
    node = Node()
    try:
        yield node, {name: node.add(name) for name in pod_names}
    finally:
        node.close()


class Running:
    """A pod's process, its log, and a stop that signals it as a pod's termination does."""

    def __init__(self, pod: Pod, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.pod, self.log = pod, log
        base = {k: os.environ[k] for k in ("PATH", "LANG", "LC_ALL") if k in os.environ}
        with open(log, "w") as f:
            self.proc = subprocess.Popen(
                pod.command(argv), stdout=f, stderr=subprocess.STDOUT,
                env={**base, "CODRAFT_NO_PRELOAD": "1", **env}, start_new_session=True,
            )  # fmt: skip

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, chars: int = 4000) -> str:
        return f"--- {self.pod.name} ---\n" + self.log.read_text(errors="replace")[-chars:]

    def stop(self, timeout: float = 120) -> int | None:
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        kill_tree(self.proc)
        return self.proc.returncode


def wait_probe(run: Running, c: dict, which: str, seconds: float, others: list[Running]) -> None:
    deadline = time.monotonic() + seconds
    ok, last = False, ""
    while time.monotonic() < deadline:
        for r in [run, *others]:
            assert r.alive(), f"{r.pod.name} exited ({r.proc.returncode}):\n{r.tail()}"
        ok, last = kubelet_probe(run.pod, c, which)
        if ok:
            return
        time.sleep(2)
    pytest.fail(
        f"{run.pod.name}: {which} never passed from the node in {seconds:.0f} s; last: {last}\n"
        + "\n".join(r.tail() for r in [run, *others])
    )


CLIENT = r"""
import json, sys, time, httpx
url, key, stop, out = sys.argv[1:5]
headers = {"Authorization": f"Bearer {key}"} if key else {}
done, failed = 0, []
with httpx.Client(base_url=url, timeout=120, headers=headers) as http:
    model = http.get("/v1/models").json()["data"][0]["id"]
    i = 0
    while not __import__("os").path.exists(stop):
        t0 = time.monotonic()
        r = http.post("/v1/completions", json={"model": model, "prompt": f"The cat {i % 7}",
                                               "max_tokens": 32, "temperature": 0.0})
        if r.status_code == 200:
            done += 1
        else:
            failed.append([r.status_code, r.text[:200]])
        i += 1
        time.sleep(max(0.2, time.monotonic() - t0))
        json.dump({"done": done, "failed": failed}, open(out + ".tmp", "w"))
        __import__("os").replace(out + ".tmp", out)
"""


def make_secrets(tmp: Path) -> dict[str, dict[str, str]]:
    """The Secrets docs/deploy.md has an operator create, made the same way."""
    from codraft.tap.auth import create_keys

    keys = {}
    for name in ("server", "learner"):
        public, secret = create_keys(tmp / "tap-keys", name)
        keys[f"{name}.key"], keys[f"{name}.key_secret"] = public.read_text(), secret.read_text()
    return {
        "codraft-control-token": {"token": secrets.token_hex(16)},
        "codraft-api-key": {"key": secrets.token_hex(16)},
        "codraft-tap-server": {k: keys[k] for k in ("server.key_secret", "learner.key")},
        "codraft-tap-learner": {k: keys[k] for k in ("learner.key_secret", "server.key")},
    }


def start_pod(
    objs: list[dict], kind: str, name: str, p: Pod, root: Path, secret: dict, extra: list[str]
) -> tuple[Running, dict]:
    spec = pod(objs, kind, name)
    c = spec["containers"][0]
    paths = _volumes(spec, c, root, p.name, secret)
    paths[IMAGE_MODEL] = root / "model"
    env = {k: _rewrite(v, paths) for k, v in _env(objs, c, secret).items()}
    argv = pod_argv(objs, kind, name, paths) + extra
    return Running(p, argv, env, root / f"{p.name}.log"), c


def _prepare(root: Path, tiny_llama_dir: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    if not (root / "model").exists():
        (root / "model").symlink_to(tiny_llama_dir)


def test_every_pod_becomes_ready_and_drafts_reach_the_server(tiny_llama_dir: Path, tmp_path):
    objs = render(OVERLAY)
    _prepare(tmp_path, tiny_llama_dir)
    secret = _secret_values(objs, make_secrets(tmp_path))
    with cluster(tmp_path, ["codraft-server-0", "codraft-learner-0", "client-0"]) as (node, pods):
        names = service_names(
            objs, {"codraft-server": pods["codraft-server-0"],
                   "codraft-learner": pods["codraft-learner-0"]}
        )  # fmt: skip
        node.resolve(names)
        lp, sp = pods["codraft-learner-0"], pods["codraft-server-0"]
        learner, lc = start_pod(
            objs, "StatefulSet", "codraft-learner", lp, tmp_path, secret, LEARNER_EXTRA
        )
        server, sc = start_pod(
            objs, "Deployment", "codraft-server", sp, tmp_path, secret, SERVER_EXTRA
        )
        both = [learner, server]
        client = None
        try:
            for run, c in ((learner, lc), (server, sc)):
                others = [r for r in both if r is not run]
                wait_probe(run, c, "startupProbe", STARTUP_S, others)
                wait_probe(run, c, "readinessProbe", 30, others)
                wait_probe(run, c, "livenessProbe", 30, others)

            # every Service port answers on the address of the pod behind it
            for svc in (o for o in objs if o["kind"] == "Service"):
                name = svc["metadata"]["name"]
                ip = names[name]
                c = sc if ip == pods["codraft-server-0"].ip else lc
                for port in svc["spec"]["ports"]:
                    number = probe_port(c, port.get("targetPort", port["port"]))
                    with socket.create_connection((ip, number), timeout=5):
                        pass

            key = _env(objs, sc, secret).get("VLLM_API_KEY", "")
            out, stop = tmp_path / "client.json", tmp_path / "client.stop"
            client = Running(
                pods["client-0"],
                [sys.executable, "-c", CLIENT, "http://codraft-server:8000", key, str(stop),
                 str(out)],
                {}, tmp_path / "client.log",
            )  # fmt: skip
            control = f"http://{pods['codraft-server-0'].ip}:{probe_port(sc, 'control')}"
            headers = {"Authorization": f"Bearer {secret['codraft-control-token']['token']}"}
            deadline, version = time.monotonic() + PUBLISH_S, 0
            while time.monotonic() < deadline and version < 1:
                for r in [*both, client]:
                    assert r.alive(), f"{r.pod.name} exited:\n{r.tail()}"
                time.sleep(3)
                info = httpx.get(f"{control}/v1/draft", headers=headers, timeout=10).json()
                version = max(info.get("version") or 0, info.get("highest_version") or 0)
            tails = "\n".join(r.tail() for r in [*both, client])
            assert version >= 1, f"no learned draft installed in {PUBLISH_S} s:\n{tails}"
            stop.touch()
            client.proc.wait(150)
            result = json.loads(out.read_text())
            assert result["done"] > 0 and not result["failed"], result
            for run, c in ((learner, lc), (server, sc)):  # still ready after the swap
                ok, last = kubelet_probe(run.pod, c, "readinessProbe")
                assert ok, last
            # a stranger without the API key gets nothing from the OpenAI port
            openai = f"http://{sp.ip}:{probe_port(sc, 'http')}"
            body = {"model": "x", "prompt": "hi", "max_tokens": 1}
            assert httpx.post(f"{openai}/v1/completions", json=body).status_code == 401

            # the pod is rescheduled (its emptyDirs are new, its claims the same): it comes
            # back serving the draft it acknowledged, not the untrained v0
            learner.stop()
            served = httpx.get(f"{control}/v1/draft", headers=headers, timeout=10).json()
            server.stop()
            moved = Pod("codraft-server-1", sp.ip, sp.netns, sp.hosts)
            server, sc = start_pod(
                objs, "Deployment", "codraft-server", moved, tmp_path, secret, SERVER_EXTRA
            )
            wait_probe(server, sc, "startupProbe", STARTUP_S, [])
            wait_probe(server, sc, "readinessProbe", 30, [])
            again = httpx.get(f"{control}/v1/draft", headers=headers, timeout=10).json()
            assert (again["version"], again["sha256"]) == (served["version"], served["sha256"]), (
                served,
                again,
            )
        finally:
            for r in [client, learner, server]:
                if r is not None:
                    r.stop()


def _without_flag(objs: list[dict], kind: str, name: str, flag: str) -> None:
    c = pod(objs, kind, name)["containers"][0]
    kept = [a for a in c["args"] if not a.startswith(f"--{flag}=")]
    assert len(kept) == len(c["args"]) - 1, f"the rendered {name} passes no --{flag}"
    c["args"] = kept


def test_a_learner_on_loopback_fails_the_kubelets_probe(tiny_llama_dir: Path, tmp_path):
    """Planted from the test side: the rendered learner without its --http-host, i.e. with the
    old default. It answers /health inside its pod and nowhere else."""
    objs = render(OVERLAY)
    _without_flag(objs, "StatefulSet", "codraft-learner", "http-host")
    _prepare(tmp_path, tiny_llama_dir)
    secret = _secret_values(objs, make_secrets(tmp_path))
    with cluster(tmp_path, ["codraft-learner-0"]) as (node, pods):
        p = pods["codraft-learner-0"]
        node.resolve(service_names(objs, {"codraft-learner": p}))
        learner, c = start_pod(objs, "StatefulSet", "codraft-learner", p, tmp_path, secret,
                               LEARNER_EXTRA)  # fmt: skip
        try:
            port = probe_port(c, c["readinessProbe"]["httpGet"]["port"])
            get = f"import httpx; print(httpx.get('http://127.0.0.1:{port}/health').status_code)"
            inside = [sys.executable, "-c", get]
            deadline, status = time.monotonic() + STARTUP_S, ""
            while time.monotonic() < deadline and status != "200":
                assert learner.alive(), learner.tail()
                time.sleep(2)
                done = subprocess.run(p.command(inside), capture_output=True, text=True)
                status = done.stdout.strip()
            assert status == "200", f"the learner never answered inside its pod:\n{learner.tail()}"
            ok, last = kubelet_probe(p, c, "readinessProbe")
            assert not ok, f"the probe from the node passed on a loopback-only learner: {last}"
        finally:
            learner.stop()
