"""Reassemble a wheel set carried in parts (prepare_lean_set.py's output) and verify it.

Run there, by scripts/gpu_vllm/install.sh and scripts/gpu_sglang/install.sh:

    python scripts/gpu_vllm/reassemble.py SRC OUT

SRC holds part1, part2, ... each with a manifest.json; OUT gets every wheel, joined from its
pieces and checked against the manifest's sha256s (a piece and the whole file), and the
manifest itself (OUT/manifest.json) for the install step to read. Standard library only.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path


def sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(1 << 22):
            h.update(b)
    return h.hexdigest()


def main(src: Path, out: Path) -> None:
    manifests = sorted(src.glob("part*/manifest.json")) + sorted(src.glob("manifest.json"))
    if not manifests:
        sys.exit(f"no {src}/part*/manifest.json: carry the parts first")
    # parts carried at different times may hold manifests of different builds: the one listing
    # the most files is the newest (a rebuild only adds wheels); its sha256s then decide
    m = max((json.loads(f.read_text()) for f in manifests), key=lambda x: len(x["files"]))
    absent = [p for p in m["parts"] if not (src / p).is_dir()]
    if absent:
        have = sorted(p.name for p in src.glob("part*"))
        sys.exit(f"parts still missing: {absent} (have {have})")
    out.mkdir(parents=True, exist_ok=True)
    for entry in m["files"]:
        dst = out / entry["name"]
        if dst.is_file() and dst.stat().st_size == entry["bytes"] and sha(dst) == entry["sha256"]:
            continue
        tmp = dst.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            for piece in entry["pieces"]:
                data = (src / piece["part"] / piece["file"]).read_bytes()
                if hashlib.sha256(data).hexdigest() != piece["sha256"]:
                    sys.exit(f"{piece['part']}/{piece['file']}: sha256 mismatch (re-carry it)")
                f.write(data)
        if sha(tmp) != entry["sha256"]:
            sys.exit(f"{entry['name']}: sha256 mismatch after reassembly")
        tmp.replace(dst)
    (out / "manifest.json").write_text(json.dumps(m, indent=1))
    print(f"verified {len(m['files'])} wheels ({m['total_bytes'] / 2**20:.1f} MiB) in {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
