"""Policy for every pod and object: what a cluster admin would refuse or regret.

Resources and probes set; non-root and the rest of the "restricted" Pod Security Standard
(which the codraft Namespace also enforces at admission); pinned images; no secret in plain text
in a Secret, a ConfigMap, an env value or a command line.
"""

from __future__ import annotations

import re

from manifests import name_of, pod_spec

# A whole word of a name (split at - and _): CONTROL_TOKEN, HF_TOKEN, --api-key; not TOKENS.
SECRET_WORDS = re.compile(
    r"(^|[-_])(TOKEN|SECRET|PASSWORD|PASSWD|API[-_]?KEY|CREDENTIALS?)([-_]|$)", re.IGNORECASE
)


def image_problems(where: str, image: str) -> list[str]:
    if "@sha256:" in image:
        return []
    tag = image.rsplit("/", 1)[-1].partition(":")[2]
    if not tag:
        return [f"{where}: image {image} has no tag, which means latest"]
    return [f"{where}: image {image} uses the latest tag"] if tag == "latest" else []


def container_policy(where: str, c: dict, pod_sc: dict, init: bool) -> list[str]:
    out, sc = image_problems(where, c["image"]), c.get("securityContext", {})
    if sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is not True:
        out.append(f"{where}: runAsNonRoot is not true")
    if sc.get("runAsUser", pod_sc.get("runAsUser")) in (0, None):
        out.append(f"{where}: runs as root (runAsUser 0 or unset)")
    if sc.get("allowPrivilegeEscalation") is not False or sc.get("privileged"):
        out.append(f"{where}: privilege escalation is allowed")
    caps = sc.get("capabilities", {})
    if caps.get("drop") != ["ALL"] or caps.get("add"):
        out.append(f"{where}: capabilities are not all dropped")
    if sc.get("seccompProfile", pod_sc.get("seccompProfile", {})).get("type") != "RuntimeDefault":
        out.append(f"{where}: no RuntimeDefault seccomp profile")
    if sc.get("readOnlyRootFilesystem") is not True:
        out.append(f"{where}: the root filesystem is writable")
    res = c.get("resources", {})
    for part, name in (("requests", "cpu"), ("requests", "memory"), ("limits", "memory")):
        if name not in res.get(part, {}):
            out.append(f"{where}: resources.{part}.{name} is not set")
    for probe in () if init else ("readinessProbe", "livenessProbe"):
        if probe not in c:
            out.append(f"{where}: no {probe}")
    for e in c.get("env", []):
        if SECRET_WORDS.search(e["name"]) and "value" in e:
            out.append(f"{where}: env {e['name']} holds a secret in plain text")
    for a in c.get("command", []) + c.get("args", []):
        flag = a.split("=", 1)[0]
        if flag.startswith("--") and SECRET_WORDS.search(flag) and not flag.endswith("-file"):
            out.append(f"{where}: a secret on the command line ({flag}); pass a file")
    return out


def policy_problems(objs: list[dict]) -> list[str]:
    out = []
    for obj in objs:
        if obj["kind"] == "Secret" and (obj.get("data") or obj.get("stringData")):
            out.append(f"{name_of(obj)}: a Secret's value is in the manifests")
        if obj["kind"] == "ConfigMap":
            keys = [k for k in obj.get("data", {}) if SECRET_WORDS.search(k)]
            out += [f"{name_of(obj)}: key {k} looks like a secret; use a Secret" for k in keys]
        spec = pod_spec(obj)
        if spec is None:
            continue
        if spec.get("hostNetwork") or spec.get("hostPID") or spec.get("hostIPC"):
            out.append(f"{name_of(obj)}: shares a host namespace")
        if any("hostPath" in v for v in spec.get("volumes", [])):
            out.append(f"{name_of(obj)}: mounts a hostPath volume")
        pod_sc = spec.get("securityContext", {})
        for init, cs in ((True, spec.get("initContainers", [])), (False, spec["containers"])):
            for c in cs:
                out += container_policy(f"{name_of(obj)}/{c['name']}", c, pod_sc, init)
    return out
