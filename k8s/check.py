"""Check kustomize overlays offline: Kubernetes schemas, codraft's pod policy and wiring.

    python k8s/check.py k8s/overlays/gpu [OVERLAY ...]

Prints every problem and exits 1 if there is any; no cluster is needed, only the dev extra
(`pip install -e '.[dev]'`). tests/test_k8s.py runs the same checks on every overlay in CI.
Run it on your own overlay before applying it: the wiring checks catch a port, rank count or
path changed in one place and not in the others.
"""

from __future__ import annotations

import sys
from pathlib import Path

from manifests import RenderError, kustomize, schema_problems
from pod_policy import policy_problems
from wiring import wiring_problems


def problems(overlay: Path) -> list[str]:
    objs = kustomize(overlay)
    return schema_problems(objs) + policy_problems(objs) + wiring_problems(objs)


def main(paths: list[str]) -> int:
    if not paths:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    failed = False
    for path in paths:
        try:
            found = problems(Path(path))
        except (RenderError, LookupError, KeyError, ValueError) as e:
            found = [f"cannot check: {e}"]
        failed |= bool(found)
        print(f"{path}: {'ok' if not found else f'{len(found)} problem(s)'}")
        for p in found:
            print(f"  - {p}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
