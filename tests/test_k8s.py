"""The Kubernetes deployment, checked offline: manifests, command lines and container images.

Every overlay is rendered by kustomize and checked by k8s/check.py's three families (schema,
pod policy, wiring); each family is also fed broken manifests to show that it fails. The command
lines are parsed by the real torchrun and codraft parsers, env names are looked up in the code
that reads them, and the Dockerfiles are linted by hadolint and compared with scripts/setup.sh.
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib
import inspect
import json
import os
import re
import sys
from importlib.metadata import requires
from importlib.util import find_spec
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
K8S, DOCKER = ROOT / "k8s", ROOT / "docker"
OVERLAYS = ("cpu-demo", "gpu", "multi-gpu-learner", "multi-node-learner")
DOCKERFILES = ("server", "server-cpu", "learner", "learner-cpu")

# k8s/check.py's modules are plain files next to the manifests; import them without leaving
# k8s/ on sys.path for the rest of the session.
sys.path.insert(0, str(K8S))
try:
    manifests = importlib.import_module("manifests")
    pod_policy = importlib.import_module("pod_policy")
    wiring = importlib.import_module("wiring")
    check = importlib.import_module("check")
finally:
    sys.path.remove(str(K8S))
_spec = importlib.util.spec_from_file_location("docker_lint", DOCKER / "lint.py")
lint = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lint)


@functools.cache
def _rendered(overlay: str) -> str:
    path = K8S / "base" if overlay == "base" else K8S / "overlays" / overlay
    return json.dumps(manifests.kustomize(path))


def render(overlay: str) -> list[dict]:
    """A fresh copy per call (kustomize runs once per overlay): tests mutate what they get."""
    return json.loads(_rendered(overlay))


def find(objs: list[dict], kind: str, name: str) -> dict:
    """One object by kind and name; a generated ConfigMap also by its name before the hash."""

    def named(n: str) -> bool:
        return n == name or (kind == "ConfigMap" and n.rsplit("-", 1)[0] == name)

    hits = [o for o in objs if o["kind"] == kind and named(o["metadata"]["name"])]
    assert len(hits) == 1, f"{kind}/{name}: {len(hits)} matches"
    return hits[0]


def pod(objs: list[dict], kind: str, name: str) -> dict:
    return find(objs, kind, name)["spec"]["template"]["spec"]


# ---- the real overlays pass --------------------------------------------------------------------


def test_every_overlay_is_checked():
    found = {p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").exists()}
    assert found == set(OVERLAYS)


@pytest.mark.parametrize("overlay", ("base", *OVERLAYS))
def test_schema_and_policy(overlay):
    objs = render(overlay)
    assert {o["kind"] for o in objs} >= {"Deployment", "StatefulSet", "Service", "ConfigMap"}
    assert manifests.schema_problems(objs) == []
    assert pod_policy.policy_problems(objs) == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_wiring(overlay):
    assert wiring.wiring_problems(render(overlay)) == []


def test_overlays_differ_where_they_should():
    def learner(overlay):
        objs = render(overlay)
        torchrun, _ = manifests.learner_flags(objs)
        gpus = pod(objs, "StatefulSet", "codraft-learner")["containers"][0]["resources"]
        return torchrun["nnodes"], torchrun["nproc-per-node"], gpus["limits"].get("nvidia.com/gpu")

    assert learner("cpu-demo") == ("1", "1", None)
    assert learner("gpu") == ("1", "1", "1")
    assert learner("multi-gpu-learner") == ("1", "8", "8")
    assert learner("multi-node-learner") == ("2", "8", "8")
    assert find(render("cpu-demo"), "Deployment", "codraft-server")["spec"]["replicas"] == 1
    assert find(render("gpu"), "Deployment", "codraft-server")["spec"]["replicas"] == 2


def test_check_cli(capsys):
    assert check.main([str(K8S / "overlays" / "gpu")]) == 0
    assert check.main([str(K8S / "no-such-overlay")]) == 1
    assert "cannot check" in capsys.readouterr().out


def test_rl_trainer_component_opens_the_control_port_to_labelled_trainers_only(tmp_path):
    def rel(path: Path) -> str:  # kustomize wants paths relative to the kustomization
        return os.path.relpath(path, tmp_path)

    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources: [{rel(K8S / 'overlays' / 'gpu')}]\n"
        f"components: [{rel(K8S / 'components' / 'rl-trainer-access')}]\n"
    )
    objs = manifests.kustomize(tmp_path)
    assert manifests.schema_problems(objs) == []
    # The strict rule reports the extra opening, and nothing else changed.
    assert wiring.wiring_problems(objs) == [
        "the server's control port 8001 admits more than the learner pods"
    ]
    np = find(objs, "NetworkPolicy", "codraft-server-rl-trainer")
    (peer,) = np["spec"]["ingress"][0]["from"]
    assert set(peer) == {"namespaceSelector", "podSelector"}  # both must match


# ---- broken manifests fail ---------------------------------------------------------------------


def test_a_broken_kustomization_fails_to_render(tmp_path):
    (tmp_path / "kustomization.yaml").write_text("resources: [missing.yaml]\n")
    with pytest.raises(manifests.RenderError, match="missing.yaml"):
        manifests.kustomize(tmp_path)


def _server(objs):
    return pod(objs, "Deployment", "codraft-server")["containers"][0]


def _break_probe_field(objs):
    _server(objs)["livenessprobe"] = _server(objs).pop("livenessProbe")


def _break_port_type(objs):
    _server(objs)["ports"][0]["containerPort"] = "8000"


def _break_missing_selector(objs):
    del find(objs, "Deployment", "codraft-server")["spec"]["selector"]


@pytest.mark.parametrize(
    "mutate, message",
    [
        (_break_probe_field, "'livenessprobe' was unexpected"),
        (_break_port_type, "'8000' is not of type 'integer'"),
        (_break_missing_selector, "'selector' is a required property"),
    ],
)
def test_schema_rejects(mutate, message):
    objs = render("gpu")
    mutate(objs)
    assert any(message in p for p in manifests.schema_problems(objs))


def _secret(objs):
    objs.append({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "t"}, "data": {}})
    objs[-1]["stringData"] = {"token": "hunter2"}


POLICY_BREAKS = {
    "latest tag": (lambda o: _server(o).update(image="codraft-server:latest"), "latest tag"),
    "no tag": (lambda o: _server(o).update(image="codraft-server"), "has no tag"),
    "root": (
        lambda o: pod(o, "Deployment", "codraft-server")["securityContext"].update(runAsUser=0),
        "runs as root",
    ),
    "escalation": (
        lambda o: _server(o)["securityContext"].update(allowPrivilegeEscalation=True),
        "privilege escalation",
    ),
    "capabilities": (
        lambda o: _server(o)["securityContext"]["capabilities"].update(add=["NET_ADMIN"]),
        "capabilities",
    ),
    "writable root": (
        lambda o: _server(o)["securityContext"].pop("readOnlyRootFilesystem"),
        "root filesystem is writable",
    ),
    "no readiness": (lambda o: _server(o).pop("readinessProbe"), "no readinessProbe"),
    "no memory limit": (
        lambda o: _server(o)["resources"]["limits"].pop("memory"),
        "resources.limits.memory",
    ),
    "secret object": (_secret, "Secret's value"),
    "token in env": (
        lambda o: _server(o)["env"].append({"name": "CONTROL_TOKEN", "value": "x"}),
        "CONTROL_TOKEN holds a secret",
    ),
    "token in args": (
        lambda o: _server(o)["args"].append("--control-token=x"),
        "secret on the command line",
    ),
    "hostPath": (
        lambda o: pod(o, "StatefulSet", "codraft-learner")["volumes"].append(
            {"name": "h", "hostPath": {"path": "/"}}
        ),
        "hostPath",
    ),
}


@pytest.mark.parametrize("case", POLICY_BREAKS)
def test_policy_rejects(case):
    mutate, message = POLICY_BREAKS[case]
    objs = render("gpu")
    mutate(objs)
    assert any(message in p for p in pod_policy.policy_problems(objs)), case


def _config(objs):
    return find(objs, "ConfigMap", "codraft-config")["data"]


def _mount(c, name):
    return next(m for m in c["volumeMounts"] if m["name"] == name)


def _learner(objs):
    return find(objs, "StatefulSet", "codraft-learner")["spec"]["template"]["spec"]["containers"][0]


def _learner_np(objs):
    return find(objs, "NetworkPolicy", "codraft-learner")["spec"]["ingress"]


WIRING_BREAKS = {
    "tap endpoint on another rank": (
        lambda o: _config(o).update(
            CODRAFT_TAP_ENDPOINTS="tcp://codraft-learner-1.codraft-learner:5558"
        ),
        "tap endpoints miss ['tcp://codraft-learner-0.codraft-learner:5557']",
    ),
    "nnodes vs replicas": (
        lambda o: find(o, "StatefulSet", "codraft-learner")["spec"].update(replicas=3),
        "--nnodes=2 but the StatefulSet has 3 pods",
    ),
    "cp does not divide": (lambda o: _config(o).update(CODRAFT_LEARNER_CP="3"), "do not split"),
    "gpus vs ranks": (
        lambda o: _config(o).update(CODRAFT_LEARNER_NPROC_PER_NODE="4"),
        "has 8 GPUs but runs 4 ranks",
    ),
    "control port open": (
        lambda o: find(o, "NetworkPolicy", "codraft-server")["spec"]["ingress"][1].pop("from"),
        "control port 8001 admits more than the learner",
    ),
    "tap port closed": (
        lambda o: _learner_np(o)[0]["ports"][0].update(port=5558),
        "tap port 5557 does not admit the server",
    ),
    "control service exposed": (
        lambda o: find(o, "Service", "codraft-server-control")["spec"].update(type="NodePort"),
        "must stay inside the cluster",
    ),
    "readiness on /health": (
        lambda o: _server(o)["readinessProbe"]["httpGet"].update(path="/health"),
        "readinessProbe must GET /ready",
    ),
    "service port typo": (
        lambda o: find(o, "Service", "codraft-server")["spec"]["ports"][0].update(targetPort="htp"),
        "port htp is no container port",
    ),
    "checkpoints writable on server": (
        lambda o: _mount(_server(o), "checkpoints").pop("readOnly"),
        "does not mount claim codraft-checkpoints read-only at /checkpoints",
    ),
    "checkpoints elsewhere on server": (
        lambda o: _mount(_server(o), "checkpoints").update(mountPath="/drafts"),
        "does not mount claim codraft-checkpoints read-only at /checkpoints",
    ),
    "work dir on the root filesystem": (
        lambda o: _server(o)["args"].append("--work-dir=/home/codraft/serve"),
        "is not on a writable volume claim of its own",
    ),
    "token file moved": (
        lambda o: _server(o)["args"].append("--control-token-file=/etc/codraft/token"),
        "is not the token Secret",
    ),
    "model differs": (
        lambda o: _server(o)["args"].append("--model=/models/other"),
        "but learner --target=/models/target",
    ),
    "no HOME volume": (
        lambda o: _server(o)["volumeMounts"].remove({"name": "cache", "mountPath": "/cache"}),
        "codraft-server/server: HOME is not a writable emptyDir",
    ),
    "old image": (
        lambda o: _server(o).update(image="codraft-server:0.0.1"),
        "is not codraft",
    ),
    "learner health on loopback": (
        lambda o: _learner(o).update(
            args=[a for a in _learner(o)["args"] if not a.startswith("--http-host")]
        ),
        "the learner's --http-host=127.0.0.1 is loopback",
    ),
    "OpenAI port open": (
        lambda o: find(o, "NetworkPolicy", "codraft-server")["spec"]["ingress"][0].pop("from"),
        "OpenAI port 8000 admits more than pods labelled",
    ),
    "OpenAI port from any namespace": (
        lambda o: find(o, "NetworkPolicy", "codraft-server")["spec"]["ingress"][0]["from"][
            1
        ].update(namespaceSelector={}),
        "OpenAI port 8000 admits more than pods labelled",
    ),
    "API key on the command line": (
        lambda o: _server(o)["args"].append("--api-key=not-a-secret"),
        "--api-key is on its command line",
    ),
    "API key in the manifest": (
        lambda o: next(e for e in _server(o)["env"] if e["name"] == "VLLM_API_KEY").update(
            value="not-a-secret", valueFrom=None
        ),
        "VLLM_API_KEY does not come from a Secret",
    ),
    "loads not confined": (
        lambda o: _server(o).update(
            args=[a for a in _server(o)["args"] if not a.startswith("--checkpoint-root")]
        ),
        "does not confine loads to the checkpoint volume",
    ),
    "buffer over the memory limit": (
        lambda o: _config(o).update(CODRAFT_LEARNER_BUFFER_BYTES=str(200 << 30)),
        "--buffer-max-bytes) but its memory limit is 512Gi",
    ),
    "rendezvous elsewhere": (
        lambda o: _config(o).update(
            CODRAFT_RDZV_ENDPOINT="codraft-learner-1.codraft-learner:29400"
        ),
        "is not pod 0's port",
    ),
}


@pytest.mark.parametrize("case", WIRING_BREAKS)
def test_wiring_rejects(case):
    mutate, message = WIRING_BREAKS[case]
    objs = render("multi-node-learner")
    mutate(objs)
    problems = wiring.wiring_problems(objs)
    assert any(message in p for p in problems), problems


def test_an_undefined_variable_in_args_is_an_error():
    objs = render("gpu")
    _server(objs)["args"].append("--max-num-seqs=$(CODRAFT_MAX_NUM_SEQS)")
    with pytest.raises(KeyError, match="CODRAFT_MAX_NUM_SEQS"):
        wiring.wiring_problems(objs)


# ---- the command lines are the ones the code accepts --------------------------------------------


def _codraft_subcommands() -> dict:
    from codraft.cli import build_parser

    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_torchrun_accepts_the_learner_launch(overlay):
    from torch.distributed.run import get_args_parser

    objs = render(overlay)
    args = manifests.argv(objs, pod(objs, "StatefulSet", "codraft-learner")["containers"][0])
    assert args[:3] == ["tini", "--", "torchrun"]
    ns = get_args_parser().parse_args(args[3:])
    assert ns.module and ns.training_script == "codraft.cli" and ns.rdzv_backend == "c10d"
    assert ns.training_script_args[0] == "learn"
    assert find_spec("codraft.cli") is not None  # what `-m codraft.cli` runs
    assert 'if __name__ == "__main__":' in (ROOT / "codraft" / "cli" / "__main__.py").read_text()


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("role", ["serve", "learn"])
def test_codraft_accepts_the_commands(overlay, role, tmp_path):
    commands = _codraft_subcommands()
    # The online learner (--server, --tap: issue 5) is still being written; today's `learn` is
    # the offline trainer. Once a parser takes the flag the manifests rely on, this test parses
    # the whole command line and fails on any flag it does not know.
    marker = {"serve": "--control-port", "learn": "--server"}[role]
    if role not in commands or marker not in commands[role]._option_string_actions:
        pytest.skip(f"`codraft {role} {marker}` is not written yet; parsed once it is")
    objs = render(overlay)
    kind, name = (
        ("Deployment", "codraft-server") if role == "serve" else ("StatefulSet", "codraft-learner")
    )
    _, program = manifests.split_argv(manifests.argv(objs, pod(objs, kind, name)["containers"][0]))
    if role == "serve":
        assert program[:2] == ["codraft", "serve"]
        program = program[2:]
    else:
        assert program[0] == "learn"
        program = program[1:]
    ns = commands[role].parse_args(program)  # argparse exits (fails the test) on an unknown flag
    if role == "serve":  # the values too: ports, tap mode, endpoints, tap keys
        from codraft.server.engine_config import check_endpoint
        from codraft.server.serve_config import config_from_args
        from codraft.tap.auth import create_keys

        # the key files are a Secret's, mounted in the pod: stand-ins made here
        assert ns.tap_key and ns.tap_learner_key, "the server's tap is not authenticated"
        ns.tap_key = str(create_keys(tmp_path, "server")[1])
        ns.tap_learner_key = str(create_keys(tmp_path, "learner")[0])
        config_from_args(ns)
        for endpoint in ns.tap_endpoint.split(","):
            check_endpoint(endpoint)


def test_server_probes_are_routes_the_server_serves():
    """The probe paths are the server's own unauthenticated routes (server/api.py)."""
    from codraft.server.api import probe_router

    served = inspect.signature(probe_router).parameters["paths"].default
    c = _server(render("gpu"))
    probed = {c[p]["httpGet"]["path"] for p in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert probed <= set(served), (probed, served)


def test_every_overlay_names_the_one_tap_socket_of_rank_0():
    """However many ranks, the learner's global rank 0 alone binds the tap (codraft.learner.
    online.feed); every overlay's server connects to it, and only to it."""
    for overlay in OVERLAYS:
        endpoints = _config_value(overlay, "CODRAFT_TAP_ENDPOINTS").split(",")
        assert endpoints == ["tcp://codraft-learner-0.codraft-learner:5557"], (overlay, endpoints)


def test_the_tap_publisher_spreads_over_several_learners():
    """A server's tap endpoint may list several learners (comma-separated): the PUSH socket
    connects to each and ZeroMQ spreads messages over them (checked here on loopback)."""
    import time

    import torch
    import zmq

    from codraft.server.publisher import TapPublisher
    from codraft.tap import TapMessage, decode

    ctx = zmq.Context.instance()
    pulls = [ctx.socket(zmq.PULL) for _ in range(2)]
    bound = []
    for s in pulls:
        s.bind("tcp://127.0.0.1:*")
        bound.append(s.getsockopt_string(zmq.LAST_ENDPOINT))
    pub = TapPublisher(",".join(bound))
    time.sleep(0.3)  # connections up (IMMEDIATE keeps messages off peers not yet connected)
    for i in range(8):
        pub.put(TapMessage.build(torch.arange(4, dtype=torch.int32), tap_layers=(1,),
                                 hidden_size=8, request_id=f"r{i}"))  # fmt: skip
    got = [0, 0]
    deadline = time.time() + 10
    while sum(got) < 8 and time.time() < deadline:
        for j, s in enumerate(pulls):
            if s.poll(50):
                decode(s.recv_multipart())
                got[j] += 1
    pub.close(timeout=1)
    for s in pulls:
        s.close(linger=0)
    assert sum(got) == 8 and min(got) > 0, got


def _dockerfile(name: str) -> str:
    return (DOCKER / f"{name}.Dockerfile").read_text()


@pytest.mark.parametrize("name", ["server-cpu", "learner-cpu"])
def test_images_prepare_the_model_with_the_real_command(name):
    code = "\n".join(ln for ln in _dockerfile(name).splitlines() if not ln.lstrip().startswith("#"))
    line = re.search(r"codraft (prepare [^\n\\&]+)", code).group(1).split()
    ns = _codraft_subcommands()["prepare"].parse_args(line[1:])
    assert ns.model == "smollm2" and ns.out == "/opt/codraft/models/smollm2"
    assert _config_value("cpu-demo", "CODRAFT_MODEL") == ns.out


def _config_value(overlay: str, key: str) -> str:
    return find(render(overlay), "ConfigMap", "codraft-config")["data"][key]


def _source_text(package: str, file: str) -> str:
    """A file of an installed package, found without importing it (vLLM's import is slow)."""
    return (Path(find_spec(package).origin).parent / file).read_text()


def _project_sources() -> str:
    return "\n".join(
        p.read_text()
        for d in ("codraft", "server", "learner", "client")
        for p in (ROOT / d).rglob("*.py")
    )


def unknown_env_names(names: set[str]) -> list[str]:
    """Names found neither in the code that reads them (vLLM, huggingface_hub) nor among the
    well-known ones: a misspelt env var does nothing, silently."""
    known = _source_text("vllm", "envs.py") + _source_text("huggingface_hub", "constants.py")
    well_known = {"HOME", "PATH", "OMP_NUM_THREADS", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE"}
    well_known |= {"NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES"}  # NVIDIA runtime
    well_known |= {"PIP_DISABLE_PIP_VERSION_CHECK", "PIP_ROOT_USER_ACTION"}  # build stages only
    return [n for n in sorted(names) if n not in well_known and f'"{n}"' not in known]


def test_env_names_are_read_by_the_code_they_configure():
    names, config_keys = set(), set()
    for overlay in OVERLAYS:
        objs = render(overlay)
        for w in manifests.workloads(objs):
            spec = manifests.pod_spec(w)
            for c in spec.get("initContainers", []) + spec["containers"]:
                names |= {e["name"] for e in c.get("env", [])}
        config_keys |= set(find(objs, "ConfigMap", "codraft-config")["data"])
    for name in DOCKERFILES:
        for block in re.findall(r"^ENV (.+?)(?<!\\)$", _dockerfile(name), re.M | re.S):
            names |= set(re.findall(r"(\w+)=", block))
    assert "VLLM_CPU_KVCACHE_SPACE" in names and unknown_env_names(names) == []
    assert unknown_env_names({"VLLM_CPU_KVCACHE_SPAC", "HF_HUB_OFLINE"}) == [
        "HF_HUB_OFLINE",
        "VLLM_CPU_KVCACHE_SPAC",
    ]
    # The ConfigMap's keys only feed $(VAR)s in the args; code reading one of them would
    # silently take a second, different route for the same setting.
    sources = _project_sources()
    assert [k for k in sorted(config_keys) if f'"{k}"' in sources] == []


# ---- images ---------------------------------------------------------------------------------


def test_hadolint_passes():
    assert lint.hadolint(*(DOCKER / f"{n}.Dockerfile" for n in DOCKERFILES)) == []


def test_hadolint_fails_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "bad.Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install vllm\n")
    assert {f["code"] for f in lint.hadolint(bad)} >= {"DL3007", "DL3013", "DL3042"}


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_rules(name):
    assert lint.dockerfile_problems(_dockerfile(name)) == []
    assert lint.dockerignore_problems(DOCKER / f"{name}.Dockerfile") == []


def test_dockerfile_rules_reject_a_root_single_stage_image(tmp_path):
    bad = tmp_path / "bad.Dockerfile"
    bad.write_text("FROM python:3.11-slim\nCOPY codraft /src\nUSER root\n")
    assert len(lint.dockerfile_problems(bad.read_text())) == 4
    (tmp_path / "bad.Dockerfile.dockerignore").write_text("!.venv\n")
    assert len(lint.dockerignore_problems(bad)) == 3  # not '*' first, codraft, .venv


def test_image_pins_follow_the_setup_script():
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    pins = dict(re.findall(r'^(\w+_VERSION)="([^"]+)"$', setup, re.M))
    cpu_server, cpu_learner = (
        lint.arg_defaults(_dockerfile("server-cpu")),
        lint.arg_defaults(_dockerfile("learner-cpu")),
    )
    for key in ("TORCH_VERSION", "VLLM_CPU_VERSION", "SMOLLM2_VERSION"):
        assert cpu_server[key] == pins[key], key
    for key in ("TORCH_VERSION", "SMOLLM2_VERSION"):
        assert cpu_learner[key] == pins[key], key
    from codraft.prepare import SMOLLM2_VERSION

    assert cpu_server["SMOLLM2_VERSION"] == SMOLLM2_VERSION
    # The GPU images share one torch, the one vLLM pins; all four share one Python base.
    gpu_server, gpu_learner = (
        lint.arg_defaults(_dockerfile("server")),
        lint.arg_defaults(_dockerfile("learner")),
    )
    assert gpu_server["TORCH_VERSION"] == gpu_learner["TORCH_VERSION"]
    assert len({lint.arg_defaults(_dockerfile(n))["PYTHON_IMAGE"] for n in DOCKERFILES}) == 1
    # The learner's own transformers pin must satisfy what vllm-cpu asks for in the server.
    pinned = re.search(r"transformers==(\S+)", _dockerfile("learner-cpu")).group(1)
    wanted = next(Requirement(r) for r in requires("vllm-cpu") if r.startswith("transformers"))
    assert wanted.specifier.contains(pinned), (pinned, str(wanted))


def test_vllm_cpu_requirements_filter_matches_the_setup_script():
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    skip = ast.literal_eval(re.search(r"^skip = (\{.*\})$", setup, re.M).group(1))
    spec = importlib.util.spec_from_file_location("vcr", DOCKER / "vllm_cpu_requirements.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.SKIP == skip


def test_deploy_guide_covers_every_overlay_and_has_its_diagram():
    guide = (ROOT / "docs" / "deploy.md").read_text()
    for overlay in OVERLAYS:
        assert f"overlays/{overlay}" in guide, overlay
    for image in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", guide):
        assert (ROOT / "docs" / image).is_file(), image
    assert re.search(r"!\[[^\]]*\]\(([^)]+\.png)\)", guide), "the guide shows no diagram"
