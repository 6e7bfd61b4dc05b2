"""Wiring: the server, the learner, their Services, NetworkPolicies and volumes agree.

Every check reads the command lines as the programs will see them (after Kubernetes' $(VAR)
expansion from the ConfigMap), so a port, a path or a rank count changed in one place and not
in the others shows up here, not in a cluster.
"""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath

from manifests import (
    CONTROL_SERVICE,
    LEARNER,
    LEARNER_METRICS_PORT,
    OPENAI_CLIENT,
    ROOT,
    SERVER,
    container,
    find,
    learner_flags,
    mount_for,
    name_of,
    pod_labels,
    pod_spec,
    port_number,
    project_version,
    selects,
    server_flags,
    workloads,
)


def _hostport(endpoint: str) -> tuple[str, int]:
    m = re.fullmatch(r"(?:tcp|https?)://([^:/]+):(\d+)/?", endpoint)
    if not m:
        raise ValueError(f"{endpoint!r} is not scheme://host:port")
    return m.group(1), int(m.group(2))


def service_problems(objs: list[dict]) -> list[str]:
    out = []
    for svc in (o for o in objs if o["kind"] == "Service"):
        backends = [w for w in workloads(objs) if selects(svc["spec"]["selector"], pod_labels(w))]
        if not backends:
            out.append(f"{name_of(svc)}: its selector matches no pods")
        for port in svc["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            for w in backends:
                if not any(port_number(c, target) for c in pod_spec(w)["containers"]):
                    out.append(
                        f"{name_of(svc)}: port {target} is no container port of {name_of(w)}"
                    )
    control = find(objs, "Service", CONTROL_SERVICE)["spec"]
    if control.get("type", "ClusterIP") != "ClusterIP" or control.get("externalIPs"):
        out.append(f"Service/{CONTROL_SERVICE}: the control API must stay inside the cluster")
    srv, c = server_flags(objs), container(find(objs, "Deployment", SERVER), "server")
    for name, flag in ((CONTROL_SERVICE, "control-port"), (SERVER, "port")):
        ports = find(objs, "Service", name)["spec"]["ports"]
        if [port_number(c, p.get("targetPort", p["port"])) for p in ports] != [int(srv[flag])]:
            out.append(f"Service/{name}: does not lead to the server's --{flag}={srv[flag]}")
    return out


def _loopback(host: str) -> bool:
    return host == "localhost" or host.startswith("127.") or host in ("::1", "[::1]")


def probe_problems(objs: list[dict]) -> list[str]:
    """Probes GET the routes that answer them, on ports bound where the kubelet reaches: the
    pod's own address (its loopback is the pod's alone; tests/test_k8s_kubelet.py probes it
    from outside)."""
    out = []
    srv = server_flags(objs)
    _, learn = learner_flags(objs)
    binds = {
        "the server's --host": srv.get("host", "127.0.0.1"),
        "the server's --control-host": srv.get("control-host", srv.get("host", "127.0.0.1")),
        "the learner's --http-host": learn.get("http-host", "127.0.0.1"),
    }
    out += [f"{what}={host} is loopback: no probe reaches it" for what, host in binds.items()
            if _loopback(host)]  # fmt: skip
    want = {
        (SERVER, "server"): {
            "startupProbe": "/health",
            "readinessProbe": "/ready",
            "livenessProbe": "/health",
            "port": int(srv["control-port"]),
        },
        (LEARNER, "learner"): {
            "startupProbe": "/health",
            "readinessProbe": "/health",
            "livenessProbe": "/health",
            "port": LEARNER_METRICS_PORT,
        },
    }
    for (workload, cname), expected in want.items():
        obj = find(objs, "Deployment" if workload == SERVER else "StatefulSet", workload)
        c = container(obj, cname)
        for probe, path in expected.items():
            if probe == "port" or probe not in c:
                continue
            get = c[probe].get("httpGet", {})
            if get.get("path") != path or port_number(c, get.get("port")) != expected["port"]:
                out.append(
                    f"{name_of(obj)}/{cname}: {probe} must GET {path} on port {expected['port']}, "
                    f"not {get.get('path')} on {get.get('port')}"
                )
    return out


def _peers(policies: list[dict], port: int) -> list[dict | None]:
    """Who the policies admit to `port`: peer dicts, or None for anyone."""
    peers: list[dict | None] = []
    for np in policies:
        for rule in np["spec"].get("ingress", []):
            ports = rule.get("ports")
            if ports and not any(p["port"] <= port <= p.get("endPort", p["port"]) for p in ports):
                continue
            peers += rule.get("from") or [None]
    return peers


def _only_pods(peers: list[dict | None], labels: list[dict]) -> bool:
    """Every peer is a same-namespace podSelector that matches pods of one of `labels` only."""
    return bool(peers) and all(
        p is not None
        and set(p) == {"podSelector"}
        and p["podSelector"].get("matchLabels")
        and any(selects(p["podSelector"], lab) for lab in labels)
        for p in peers
    )


def _only_labelled(peers: list[dict | None], label: dict) -> bool:
    """Every peer selects pods by `label` (in this namespace, or in namespaces with it)."""
    return bool(peers) and all(
        p is not None
        and set(p) <= {"podSelector", "namespaceSelector"}
        and selects(p["podSelector"], label)
        and p["podSelector"].get("matchLabels") == label
        and p.get("namespaceSelector", {"matchLabels": label}).get("matchLabels") == label
        for p in peers
    )


def network_problems(objs: list[dict]) -> list[str]:
    server = pod_labels(find(objs, "Deployment", SERVER))
    learner = pod_labels(find(objs, "StatefulSet", LEARNER))
    nps = [o for o in objs if o["kind"] == "NetworkPolicy"]
    guarding = {
        role: [n for n in nps if selects(n["spec"]["podSelector"], labels)]
        for role, labels in (("server", server), ("learner", learner))
    }
    out = [f"no NetworkPolicy selects the {r} pods" for r, g in guarding.items() if not g]
    if out:
        return out
    control = int(server_flags(objs)["control-port"])
    if not _only_pods(_peers(guarding["server"], control), [learner]):
        out.append(f"the server's control port {control} admits more than the learner pods")
    openai = int(server_flags(objs)["port"])
    if not _only_labelled(_peers(guarding["server"], openai), OPENAI_CLIENT):
        out.append(
            f"the server's OpenAI port {openai} admits more than pods labelled {OPENAI_CLIENT}"
        )
    torchrun, learn = learner_flags(objs)
    port = _hostport(learn["tap"])[1]  # rank 0's, the one tap socket
    peers = _peers(guarding["learner"], port)
    if not _only_pods(peers, [server, learner]):
        out.append(f"the learner's tap port {port} admits more than server and learner pods")
    if not any(p and selects(p.get("podSelector", {}), server) for p in peers):
        out.append(f"the learner's tap port {port} does not admit the server pods")
    rdzv = _hostport("tcp://" + torchrun["rdzv-endpoint"])[1]
    if not any(p and selects(p["podSelector"], learner) for p in _peers(guarding["learner"], rdzv)):
        out.append(f"learner pods cannot reach each other's rendezvous port {rdzv}")
    return out


_UNITS = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "K": 10**3, "M": 10**6,
          "G": 10**9, "T": 10**12}  # fmt: skip


def _bytes(quantity: str) -> int:
    """A Kubernetes memory quantity ('4Gi', '512Mi', '1000000') in bytes."""
    m = re.fullmatch(r"(\d+)([KMGT]i?)?", str(quantity))
    if not m:
        raise ValueError(f"memory quantity {quantity!r}: expected digits and a unit such as Gi")
    return int(m.group(1)) * _UNITS.get(m.group(2) or "", 1)


def learner_problems(objs: list[dict]) -> list[str]:
    """torchrun geometry, rendezvous, tap endpoints and the control URL."""
    out = []
    sts = find(objs, "StatefulSet", LEARNER)
    svc_name = sts["spec"]["serviceName"]
    svc = find(objs, "Service", svc_name)
    if svc["spec"].get("clusterIP") != "None" or not svc["spec"].get("publishNotReadyAddresses"):
        out.append(f"{name_of(svc)}: must be headless and publish not-ready pods (rendezvous)")
    torchrun, learn = learner_flags(objs)
    replicas, nproc = sts["spec"].get("replicas", 1), int(torchrun["nproc-per-node"])
    if int(torchrun["nnodes"]) != replicas:
        out.append(
            f"torchrun --nnodes={torchrun['nnodes']} but the StatefulSet has {replicas} pods"
        )
    if (replicas * nproc) % (int(learn["cp"]) * int(learn["pp"])):
        out.append(
            f"{replicas}x{nproc} ranks do not split into cp={learn['cp']} x pp={learn['pp']}"
        )
    c = container(sts, "learner")
    gpus = c["resources"].get("limits", {}).get("nvidia.com/gpu")
    if gpus is not None and int(gpus) != nproc:
        out.append(f"the learner pod has {gpus} GPUs but runs {nproc} ranks")

    svc_ports = {p["port"] for p in svc["spec"]["ports"]}
    host, rdzv = _hostport("tcp://" + torchrun["rdzv-endpoint"])
    if host != f"{LEARNER}-0.{svc_name}" or port_number(c, rdzv) is None or rdzv not in svc_ports:
        out.append(f"rendezvous {torchrun['rdzv-endpoint']} is not pod 0's port in {svc_name}")

    # global rank 0 (pod 0, local rank 0) alone binds the tap socket and feeds every rank
    bind_host, tap_port = _hostport(learn["tap"])
    want = {f"tcp://{LEARNER}-0.{svc_name}:{tap_port}"}
    got = server_flags(objs)["tap-endpoint"].split(",")
    if bind_host != "0.0.0.0":
        out.append(f"the learner binds its tap socket on {bind_host}, not on all interfaces")
    if len(got) != len(set(got)) or set(got) != want:
        out.append(
            f"the server's tap endpoints miss {sorted(want - set(got))} "
            f"and name unknown {sorted(set(got) - want)} (or repeat one): only the learner's "
            "rank 0 binds one"
        )
    if port_number(c, tap_port) is None or tap_port not in svc_ports:
        out.append(f"tap port {tap_port} is missing from the learner's ports or {name_of(svc)}")

    limit = _bytes(c["resources"].get("limits", {}).get("memory", "0"))
    buffered = int(learn.get("buffer-max-bytes", 2 << 30))
    if not limit or buffered > limit // 4:
        out.append(
            f"the learner buffers up to {buffered} bytes (--buffer-max-bytes) but its memory "
            f"limit is {c['resources'].get('limits', {}).get('memory')}: keep it under a quarter"
        )

    srv_c = container(find(objs, "Deployment", SERVER), "server")
    if learn["server"] != f"http://{CONTROL_SERVICE}:{server_flags(objs)['control-port']}":
        out.append(f"the learner's --server={learn['server']} is not the control Service")
    if port_number(srv_c, int(server_flags(objs)["control-port"])) is None:
        out.append("the server's --control-port is not one of its container ports")
    return out


def _baked_into(image: str, path: str) -> bool:
    """Whether the Dockerfile of `image` writes `path` (`codraft prepare ... --out PATH`)."""
    dockerfile = dockerfile_for(image)
    text = dockerfile.read_text() if dockerfile.is_file() else ""
    return re.search(rf"--out[ =]{re.escape(path)}(\s|$)", text) is not None


def _volume(obj: dict, name: str) -> dict:
    return next(v for v in pod_spec(obj).get("volumes", []) if v["name"] == name)


def volume_problems(objs: list[dict]) -> list[str]:
    out = []
    server, sts = find(objs, "Deployment", SERVER), find(objs, "StatefulSet", LEARNER)
    srv, (_, learn) = server_flags(objs), learner_flags(objs)
    pods = [(server, container(server, "server"), srv), (sts, container(sts, "learner"), learn)]

    secrets = set()
    for obj, c, args in pods:
        path = PurePosixPath(args["control-token-file"])
        hit = mount_for(pod_spec(obj), c, str(path))
        secret = hit and hit[1].get("secret")
        items = {i["key"]: i["path"] for i in (secret or {}).get("items", [])}
        if not secret or not hit[0].get("readOnly") or items.get("token") != path.name:
            out.append(f"{name_of(obj)}: --control-token-file={path} is not the token Secret")
        else:
            secrets.add(secret["secretName"])
    if len(secrets) > 1:
        out.append(f"server and learner read different token Secrets: {sorted(secrets)}")

    # The learner posts each draft by its path on the checkpoint volume: the server must mount
    # the same claim at the same path (read-only), or it cannot find what it is told to load.
    learner_c, server_c = pods[1][1], pods[0][1]
    hit = mount_for(pod_spec(sts), learner_c, learn["out"])
    claim = hit and hit[1].get("persistentVolumeClaim", {}).get("claimName")
    if not claim or hit[0].get("readOnly"):
        out.append(f"the learner's --out={learn['out']} is not on a writable volume claim")
    else:
        same = [
            m
            for m in server_c.get("volumeMounts", [])
            if m["mountPath"] == hit[0]["mountPath"]
            and _volume(server, m["name"]).get("persistentVolumeClaim", {}).get("claimName")
            == claim
        ]
        if not same or not same[0].get("readOnly"):
            out.append(
                f"the server does not mount claim {claim} read-only at {hit[0]['mountPath']}, "
                "where the learner's drafts are"
            )
    # The committed-draft record and the server's draft copies must outlive the pod.
    work = mount_for(pod_spec(server), server_c, srv.get("work-dir", ""))
    work_claim = work and work[1].get("persistentVolumeClaim", {}).get("claimName")
    if not work_claim or work[0].get("readOnly") or work_claim == claim:
        out.append(
            f"the server's --work-dir={srv.get('work-dir')} is not on a writable volume claim "
            "of its own (the committed-draft record would not outlive the pod)"
        )
    root = srv.get("checkpoint-root")
    if not root or not hit or PurePosixPath(root) != PurePosixPath(hit[0]["mountPath"]):
        out.append(
            f"the server's --checkpoint-root={root} does not confine loads to the checkpoint "
            f"volume{' at ' + hit[0]['mountPath'] if hit else ''}"
        )

    if srv["model"] != learn["target"]:
        out.append(f"server --model={srv['model']} but learner --target={learn['target']}")
    for obj, c in ((server, server_c), (sts, learner_c)):
        hit = mount_for(pod_spec(obj), c, srv["model"])
        if hit is None and not _baked_into(c["image"], srv["model"]):
            out.append(
                f"{name_of(obj)}/{c['name']}: model {srv['model']} is neither mounted "
                f"nor built into {c['image']}"
            )
        elif hit is not None and not hit[0].get("readOnly"):
            out.append(f"{name_of(obj)}/{c['name']}: the model volume is mounted writable")

    claims = {o["metadata"]["name"] for o in objs if o["kind"] == "PersistentVolumeClaim"}
    for obj in workloads(objs):
        spec = pod_spec(obj)
        for c in spec.get("initContainers", []) + spec["containers"]:
            # The root filesystem is read-only: HOME (caches) must be a writable scratch volume.
            home = next((e.get("value") for e in c.get("env", []) if e["name"] == "HOME"), None)
            hit = home and mount_for(spec, c, home)
            if not hit or "emptyDir" not in hit[1]:
                out.append(f"{name_of(obj)}/{c['name']}: HOME is not a writable emptyDir")
        for v in spec.get("volumes", []):
            name = v.get("persistentVolumeClaim", {}).get("claimName")
            if name and name not in claims:
                out.append(f"{name_of(obj)}: claim {name} is not among the manifests")
    return out


def dockerfile_for(image: str) -> Path:
    """docker/<name without codraft->.Dockerfile for an image name such as codraft-server-cpu."""
    name = image.rsplit("/", 1)[-1].split("@")[0].split(":")[0]
    return ROOT / "docker" / f"{name.removeprefix('codraft-')}.Dockerfile"


def image_wiring_problems(objs: list[dict]) -> list[str]:
    out, version = [], project_version()
    for obj in workloads(objs):
        for c in pod_spec(obj).get("initContainers", []) + pod_spec(obj)["containers"]:
            image = c["image"]
            if not dockerfile_for(image).is_file():
                out.append(f"{name_of(obj)}/{c['name']}: no docker/ file builds {image}")
            tag = image.rsplit("/", 1)[-1].partition(":")[2]
            if "@" not in image and tag != version:
                out.append(f"{name_of(obj)}/{c['name']}: {image} is not codraft {version}")
    return out


def secret_problems(objs: list[dict]) -> list[str]:
    """The OpenAI port's API key comes from a Secret, never from the manifests' text."""
    c = container(find(objs, "Deployment", SERVER), "server")
    if any(a.startswith("--api-key") for a in c.get("args", [])):
        return ["the server's --api-key is on its command line: read it from a Secret"]
    env = {e["name"]: e for e in c.get("env", [])}
    ref = (env.get("VLLM_API_KEY", {}).get("valueFrom") or {}).get("secretKeyRef")
    return [] if ref else ["the server's VLLM_API_KEY does not come from a Secret"]


def wiring_problems(objs: list[dict]) -> list[str]:
    return (
        service_problems(objs)
        + secret_problems(objs)
        + probe_problems(objs)
        + network_problems(objs)
        + learner_problems(objs)
        + volume_problems(objs)
        + image_wiring_problems(objs)
    )
