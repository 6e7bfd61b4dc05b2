"""Make this checkout importable in a Python environment whose pip cannot install it (no
setuptools there): what `pip install -e .` gives, written by hand.

    .gpu_venv/bin/python scripts/gpu_vllm/link_codraft.py [REPO]    # REPO: default this checkout

Run it with the interpreter of the environment to fill (scripts/gpu_vllm/install.sh does, when
`pip install -e .` fails). Into that interpreter's site-packages it writes

- `_codraft_checkout.py`: a finder for the import names of pyproject.toml's
  [tool.setuptools.package-dir] (`codraft`, `codraft.server` -> REPO/server, `codraft.learner`,
  `codraft.client`): the folders stay where they are, the names are the installed ones;
- `codraft-checkout.pth`: the line that installs that finder when Python starts;
- `codraft-<version>.dist-info`: the metadata and the entry points of pyproject.toml
  ([project.scripts], [project.entry-points], so vLLM finds the `vllm.general_plugins` one).

Only the standard library; running it again rewrites the same files.
"""

from __future__ import annotations

import sys
import sysconfig
import tomllib
from pathlib import Path

FINDER = "_codraft_checkout"

FINDER_SOURCE = '''"""codraft's import names mapped onto the checkout at {root}
(written by scripts/gpu_vllm/link_codraft.py)."""

import sys
from importlib.util import spec_from_file_location
from pathlib import Path

MAPPING = {mapping!r}


class CheckoutFinder:
    """Finds the packages of MAPPING; their modules and subpackages then come from their
    folders the ordinary way."""

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        folder = MAPPING.get(fullname)
        if folder is None:
            return None
        init = Path(folder, "__init__.py")
        return spec_from_file_location(fullname, init, submodule_search_locations=[folder])


def install():
    if not any(getattr(f, "__name__", "") == "CheckoutFinder" for f in sys.meta_path):
        sys.meta_path.append(CheckoutFinder)
'''


def package_mapping(root: Path, project: dict) -> dict[str, str]:
    """Import name -> folder, from [tool.setuptools.package-dir] (every folder must exist)."""
    dirs = project.get("tool", {}).get("setuptools", {}).get("package-dir", {})
    if not dirs:
        raise SystemExit(f"{root}/pyproject.toml has no [tool.setuptools.package-dir]")
    mapping = {}
    for name, rel in dirs.items():
        folder = (root / rel).resolve()
        if not (folder / "__init__.py").is_file():
            raise SystemExit(f"package-dir {name} = {rel!r}: no {folder}/__init__.py")
        mapping[name] = str(folder)
    return mapping


def entry_points(project: dict) -> str:
    """entry_points.txt: [project.scripts] as console_scripts, then every [project.entry-points]."""
    groups = {"console_scripts": project["project"].get("scripts", {})}
    groups.update(project["project"].get("entry-points", {}))
    out = []
    for group, eps in groups.items():
        if eps:
            out.append(f"[{group}]")
            out += [f"{name} = {value}" for name, value in eps.items()]
            out.append("")
    return "\n".join(out)


def link(root: Path, site: Path) -> dict[str, str]:
    project = tomllib.loads((root / "pyproject.toml").read_text())
    name, version = project["project"]["name"], project["project"]["version"]
    mapping = package_mapping(root, project)
    (site / f"{FINDER}.py").write_text(FINDER_SOURCE.format(root=root, mapping=mapping))
    (site / "codraft-checkout.pth").write_text(f"import {FINDER}; {FINDER}.install()\n")
    # earlier kits put the repository root itself on sys.path (top-level server, learner, ...)
    (site / "codraft-local.pth").unlink(missing_ok=True)
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(entry_points(project))
    (info / "top_level.txt").write_text("codraft\n")
    (info / "RECORD").write_text("")
    (info / "INSTALLER").write_text("scripts/gpu_vllm/link_codraft.py\n")
    return mapping


def main(argv: list[str]) -> int:
    root = Path(argv[0] if argv else Path(__file__).resolve().parents[2]).resolve()
    site = Path(sysconfig.get_paths()["purelib"])
    mapping = link(root, site)
    print(f"{site}: {', '.join(f'{k} -> {v}' for k, v in mapping.items())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
