"""Build the lean SGLang 0.5.17 wheel set for an offline GPU machine (run here, PyPI reachable).

The SGLang counterpart of scripts/gpu_vllm/prepare_lean_set.py, whose repack, RECORD check and
split/manifest code it imports (that file stays untouched). The GPU machine (one H200, sm_90) has
Python 3.12.3, torch 2.11.0 + CUDA 13 (nvcc too), triton 3.6.0, transformers 5.17.0 and the other
packages of IMAGE below (its transformers, 5.17.0, is shadowed in the SGLang venv by sglang's
pinned 5.12.1: 5.17.0 defines a config that sglang registers again), no network, and takes
files in carried folders of at most 64 MiB per call. sglang 0.5.17 pins torch==2.11.0, the
image's (later releases pin 2.13/2.14).
This script

1. downloads (`pip download --no-deps`, pinned, cp312, manylinux x86_64 up to glibc 2.39) the
   wheels that SGLang's `Engine` / `launch_server` imports to serve a dense Llama (SmolLM2) with
   EAGLE-3 speculative decoding and that the image lacks (SHIP: sglang itself, sglang-kernel,
   flashinfer-python (JIT-compiles with the image's nvcc), sgl-deep-gemm, xgrammar, ... and
   the small wheels they import). Versions: sglang's own pins, the rest as pip resolved
   `sglang==0.5.17` with `--uploaded-prior-to 2026-08-09` (the release sglang 0.5.17 was
   tested against). Requirements that are never imported on that path stay out (LEFT_OUT,
   each with the reason); the image's own packages are not shipped (IMAGE), also where
   sglang pins another version whose difference it does not check (ACCEPTED);
2. repacks sglang-kernel, sglang and xgrammar without what an H200 never loads for that path
   (DROPS, each with the reason), with RECORD rewritten and re-verified. sglang-kernel's
   `flash_ops.abi3.so` (FA3, 1071 MiB unpacked, 326 MiB packed: 80 % of the set) is one fat
   .so whose 372 fatbins hold SASS for sm_80 (257 MiB), sm_86 (257 MiB) and sm_90 (474 MiB),
   no PTX; it is what `--attention-backend fa3` (the H200 default for MHA models) loads, so
   it stays whole. sm90/common_ops.abi3.so is likewise fat (sm_80 ... sm_120) and stays.
   `--no-fa3` leaves it out too (NO_FA3: 96 MiB in 2 parts instead of 8), for serving with
   `--attention-backend flashinfer`. A changed DROPS needs `rm -r <out>/repacked*` (a repack
   is redone only for a newer source);
3. checks that every Requires-Dist (no extras; markers for CPython 3.12 / Linux / x86_64) of
   every shipped wheel is shipped at a matching version, is on the image, or is in LEFT_OUT,
   and stops on anything else;
4. splits everything into `<out>/part1`, `part2`, ... of at most `--part-mib` MiB each (files
   larger than a part go in byte pieces, joined there), with `manifest.json` (sha256 of every
   file and piece) in every part.

    .venv/bin/python scripts/gpu_sglang/prepare_lean_set.py      # -> .gpu_sglang_wheels/
    .venv/bin/python scripts/gpu_sglang/prepare_lean_set.py --no-fa3  # 2 parts, no FA3
    .venv/bin/python scripts/gpu_sglang/prepare_lean_set.py --check-only   # step 3 alone
    bash scripts/gpu_sglang/install.sh                           # there, see that file
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import re
import sys
import zipfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.version import Version


def _load_vllm_kit():
    """scripts/gpu_vllm/prepare_lean_set.py as a module (scripts/ is no package)."""
    path = Path(__file__).resolve().parent.parent / "gpu_vllm" / "prepare_lean_set.py"
    spec = importlib.util.spec_from_file_location("codraft_gpu_vllm_lean_set", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its @dataclass looks itself up there
    spec.loader.exec_module(module)
    return module


kit = _load_vllm_kit()
MiB = kit.MiB
Wheel = kit.Wheel

SGLANG = "sglang==0.5.17"
SHIP = (
    SGLANG,
    # sglang's pins
    "sglang-kernel==0.4.5",  # sgl_kernel: FA3, norms, rope, EAGLE tree kernels (repacked)
    "flashinfer-python==0.6.15.post1",  # sampling + flashinfer attention, JIT with nvcc
    "sgl-deep-gemm==0.1.5.post1",  # deep_gemm: dsa_backend imports it unguarded on CUDA, and
    # eagle_worker_v2 imports dsa_backend when it sets up the draft-extend CUDA graph
    "apache-tvm-ffi==0.1.11",  # tvm_ffi: flashinfer.jit, deep_gemm, xgrammar, sglang's JIT
    "xgrammar==0.2.1",  # default grammar backend; function_call detectors import it (repacked)
    "openai==2.6.1",  # entrypoints/openai/protocol.py
    "transformers==5.12.1",  # the image's 5.17.0 defines qwen3_asr, which sglang's configs
    # register again: every serving module then fails to import (seen on the H200, 2026-12-04)
    "tokenizers==0.22.2",  # transformers 5.12.1 wants <=0.23.0, checked at import (no 0.23.0 final)
    # unpinned requirements of sglang that its serving path imports at module level
    "compressed-tensors==0.18.0",  # layers/quantization/__init__ -> compressed_tensors
    "loguru==0.7.3",  # compressed-tensors
    "gguf==0.19.0",  # layers/quantization/gguf.py
    "fastapi==0.142.2",
    "starlette==1.7.0",
    "opentelemetry-api==1.45.0",  # fastapi 0.142 imports it (fastapi/telemetry)
    "uvicorn==0.54.0",
    "python-multipart==0.0.32",  # fastapi's Form/File routes (transcription, files)
    "pydantic==2.13.4",
    "pydantic-core==2.46.4",
    "annotated-types==0.8.0",
    "typing-inspection==0.4.4",
    "orjson==3.11.9",
    "msgspec==0.21.1",
    "pybase64==1.5.0",
    "partial-json-parser==0.2.1.1.post7",
    "pyzmq==27.1.0",
    "setproctitle==1.3.7",
    "soundfile==0.13.1",  # entrypoints/openai/serving_transcription (imported by http_server)
    "cffi==2.1.1",  # soundfile
    "pycparser==3.0",  # cffi
    "zstandard==0.25.0",  # entrypoints/http_request_decompression.py
    "distro==1.9.0",  # openai
    "jiter==0.16.0",  # openai
    "sniffio==1.3.1",  # openai
    # imported at module level but not in sglang's Requires-Dist (they came through datasets
    # and outlines, both left out)
    "dill==0.4.1",  # sampling/custom_logit_processor.py
    "jsonschema==4.26.0",  # entrypoints/openai/serving_chat.py
    "jsonschema-specifications==2025.9.1",
    "referencing==0.37.0",
    "rpds-py==2026.6.3",
    # sglang/utils.py: `from IPython.display import HTML, display` (models/llama.py imports it)
    "ipython==9.17.1",
    "ipython-pygments-lexers==1.1.1",
    "jedi==0.20.0",
    "parso==0.8.7",
    "matplotlib-inline==0.2.2",
    "traitlets==5.16.1",
    "pexpect==4.9.0",
    "ptyprocess==0.7.0",
    "prompt-toolkit==3.0.53",
    "wcwidth==0.9.1",
    "stack-data==0.6.3",
    "executing==2.2.1",
    "asttokens==3.0.2",
    "pure-eval==0.2.4",
)

# Requirements (of sglang and of the shipped wheels) that are neither shipped nor on the image:
# nothing on the path `Engine`/`launch_server` -> dense Llama + EAGLE-3 on an H200 imports them.
LEFT_OUT = {
    "anthropic": "only sglang.lang.backend.anthropic (frontend DSL backend) and check_env",
    "blobfile": "only srt/connector/azure.py (loading weights from Azure blob storage)",
    "cuda-python": "a metapackage: the cuda.bindings / cuda.core it pulls are on the image",
    "datasets": "benchmarks and evals only (bench_serving, eval/)",
    "easydict": "not imported by sglang 0.5.17",
    "flash-attn-4": "FA4 (CuTe DSL, the sm_100 `fa4` backend); on sm_90 `fa3` runs "
    "sgl_kernel.flash_attn (SGLANG_USE_SGL_FA3_KERNEL=1, the default)",
    "helion": "only the helion MoE kernels (inkling_moe, moe_runner helion_utils), lazily",
    "humming-kernels": "only --quantization humming (lazy import)",
    "interegular": "outlines grammar backend only",
    "outlines": "--grammar-backend outlines only (default: xgrammar)",
    "llguidance": "--grammar-backend llguidance only",
    "kernels": "FA3 from the HF kernels hub, only with SGLANG_USE_SGL_FA3_KERNEL=0 (downloads)",
    "mistral-common": "only models/voxtral.py",
    "modelscope": "only with SGLANG_USE_MODELSCOPE=1",
    "nvidia-cutlass-dsl": "CuTe DSL kernels (FA4, DSA/DSv4 indexers, flashinfer cute_dsl): "
    "imported inside functions; flashinfer/__init__ imports its CuTe APIs under "
    "contextlib.suppress(ImportError)",
    "nvidia-mathdx": "headers for the JIT LPLB solver (MoE expert load balancing) only",
    "openai-harmony": "gpt-oss (harmony) chat/tool paths only, imported lazily",
    "py-spy": "a profiler binary; sglang 0.5.17 does not import or call it",
    "quack-kernels": "CuTe DSL helpers of sglang's vendored FA4 (kernels/ops/attention/"
    "flash_attn/cute) only",
    "smg-grpc-servicer": "--smg-grpc-mode only",
    "tilelang": "DeepSeek sparse attention / mHC / HIP FlashMLA kernels only, lazily",
    "tokenspeed-mla": "MLA backend; imported only when is_tokenspeed_mla_available()",
    "torch-memory-saver": "imported in a try (utils/torch_memory_saver_adapter.py); only "
    "--enable-memory-saver needs it",
    "torchao": "only with --torchao-config (lazy import in layers/torchao_utils.py)",
    "torchcodec": "video decoding for multimodal models, imported in a try",
    "watchfiles": "uvicorn --reload only; sglang does not import it",
    # flashinfer-python's own requirements
    "cuda-tile": "flashinfer.cutile (cuTile kernels), imported inside functions",
    "nccl4py": "flashinfer.moe_ep only (MoE expert parallelism)",
    "nvidia-cudnn-frontend": "flashinfer's cuDNN attention/GEMM paths, imported in a try",
}

# The image's packages (KINDS.md, 2026-11-17): never shipped. Versions where they are known.
IMAGE = frozenset(
    """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs
    botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy
    coverage cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython
    diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools formulaic
    frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
    hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib
    jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator
    lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes
    mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx
    ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc
    nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand
    nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13
    nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
    opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging
    pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf
    psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest
    pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
    pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core
    scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools
    shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
    tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz
    torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers
    treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug
    wheel wrapt xarray xxhash yarl zipp""".split()
)
IMAGE_VERSIONS = {
    "torch": "2.11.0",
    "torchaudio": "2.11.0",
    "torchvision": "0.26.0",
    "triton": "3.6.0",
    "transformers": "5.17.0",
    "tokenizers": "0.23.2",
    "safetensors": "0.8.0",
    "huggingface-hub": "1.33.0",
    "numpy": "2.5.2",
    "sentencepiece": "0.2.2",
    "tiktoken": "0.14.0",
}
# Pins that the image's version does not meet, kept as the image has them.
ACCEPTED = {
    "numba": "sglang pins ==0.65.1; not imported on this path; the image's numba stays",
    "timm": "sglang pins ==1.0.16; vision towers only, not imported on this path; the image's "
    "timm stays",
}

# What the repacked wheels leave out, and why an H200 (sm_90) serving a dense Llama with
# EAGLE-3 never loads it. Keyed by the distribution's normalized name.
DROPS: dict[str, tuple[tuple[str, str], ...]] = {
    "sglang_kernel": (
        (
            r"sgl_kernel/sm100/common_ops\.abi3\.so",
            "common_ops for compute capability != 9.0: load_utils."
            "_load_architecture_specific_ops loads sm90/common_ops on capability 90 (H200)",
        ),
        (
            r"sgl_kernel/infllm_ops\.cpython-310-x86_64-linux-gnu\.so",
            "InfLLM-V2 sparse attention, built for CPython 3.10: loaded only when "
            "infllmv2_attn_stage1 is called (infllm_v2/_loader.py), which sglang never calls",
        ),
    ),
    "sglang": (
        (
            r"sglang/srt/server/_core\.cpython-312-x86_64-linux-gnu\.so",
            "embedded Rust HTTP server: only with SGLANG_RUST_SERVER=1 (managers/rust_server.py)",
        ),
        (
            r"sglang/srt/grpc/_core\.cpython-312-x86_64-linux-gnu\.so",
            "native gRPC server: only with --grpc-port (http_server.py imports it lazily)",
        ),
        (
            r"sglang/multimodal_gen/.*[^/]",  # files only: RECORD lists no folder entries
            "diffusion serving (`sglang generate`, diffusion models): cli/utils.py imports it "
            "in a try; sglang.srt never does",
        ),
    ),
    "xgrammar": (
        (
            r"xgrammar/lib/libxgrammar\.a",
            "static archive for C++ builds; Python loads libxgrammar_bindings.so through "
            "tvm_ffi (load_binding.py), nothing opens lib/",
        ),
    ),
}

# --no-fa3 (opt-in): sglang-kernel without FlashAttention-3, 326 MiB of the set. The
# server must then run with `--attention-backend flashinfer` (or triton): the H200 default for
# a Llama (MHA, EAGLE topk 1) is fa3, which would fail at its first attention call.
NO_FA3 = (
    r"sgl_kernel/flash_ops\.abi3\.so",
    "FA3 (SASS sm_80/86/90): loaded only by sgl_kernel.flash_attn, which sglang imports lazily "
    "(kernels/ops/attention/flash_attention_v3.py) for --attention-backend fa3",
)

# glibc up to 2.39 (the GPU image is Ubuntu 24.04, Python 3.12.3); sglang 0.5.17 is 2_34
PLATFORMS = tuple(f"manylinux_2_{v}_x86_64" for v in range(39, 4, -1)) + (
    "manylinux2014_x86_64",
    "manylinux2010_x86_64",
    "manylinux1_x86_64",
)
TARGET_ENV = default_environment() | {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "extra": "",
}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@contextlib.contextmanager
def _kit_globals(**values):
    """Run the vLLM kit's functions with other module globals (its DROP, PLATFORMS)."""
    old = {k: getattr(kit, k) for k in values}
    for k, v in values.items():
        setattr(kit, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(kit, k, v)


def download(pins: list[str], dest: Path) -> None:
    with _kit_globals(PLATFORMS=PLATFORMS):
        kit.pip_download(pins, dest)


def repack(src: Path, dst: Path, drops: tuple[tuple[str, str], ...]) -> None:
    """The vLLM kit's repack (RECORD rewritten) and RECORD check, with these drops."""
    with _kit_globals(DROP=drops):
        dropped = kit.repack_vllm(src, dst)
    for pattern, why in drops:
        hit = [size for name, size in dropped if re.fullmatch(pattern, name)]
        if not hit:
            raise SystemExit(f"{src.name}: DROP {pattern} matched nothing (wheel changed?)")
        print(f"    dropped {len(hit):4d} files, {sum(hit) / MiB:7.1f} MiB unpacked: {why}")
    kit.check_record(dst)


def requires(wheel: Path) -> tuple[str, str, list[Requirement]]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    name = re.search(r"^Name: (.+)$", text, re.M).group(1).strip()
    version = re.search(r"^Version: (.+)$", text, re.M).group(1).strip()
    reqs = [Requirement(v) for v in re.findall(r"^Requires-Dist: (.+)$", text, re.M)]
    return name, version, reqs


def check_closure(wheels: list[Path]) -> list[str]:
    """Every requirement of every shipped wheel: shipped (matching), image, or LEFT_OUT."""
    shipped = {}
    reqs = {}
    for w in wheels:
        name, version, rs = requires(w)
        shipped[norm(name)] = version
        reqs[norm(name)] = rs
    problems, notes = [], []
    for owner in sorted(reqs):
        for req in reqs[owner]:
            if req.marker is not None and not req.marker.evaluate(TARGET_ENV):
                continue  # extras, other platforms
            dep, spec = norm(req.name), req.specifier
            where = f"{owner} requires {req}"
            if dep in shipped:
                if spec and not spec.contains(Version(shipped[dep]), prereleases=True):
                    problems.append(f"{where}: shipped {shipped[dep]}")
            elif dep in IMAGE:
                have = IMAGE_VERSIONS.get(dep)
                if have and spec and not spec.contains(Version(have), prereleases=True):
                    if dep not in ACCEPTED:
                        problems.append(f"{where}: the image has {have}")
                    else:
                        notes.append(f"{where}: image has {have}, kept: {ACCEPTED[dep]}")
            elif dep in LEFT_OUT:
                notes.append(f"{where}: left out: {LEFT_OUT[dep]}")
            else:
                problems.append(f"{where}: neither shipped, on the image nor in LEFT_OUT")
    for n in notes:
        print(f"  note  {n}")
    for p in problems:
        print(f"  ERROR {p}")
    return problems


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=".gpu_sglang_wheels", help="output folder (git-ignored)")
    p.add_argument("--part-mib", type=float, default=56.0, help="largest part, MiB")
    p.add_argument("--check-only", action="store_true", help="download + closure check only")
    p.add_argument(
        "--no-fa3",
        action="store_true",
        help="leave out FA3 (2 parts instead of 8; serve with --attention-backend flashinfer)",
    )
    args = p.parse_args()
    out = Path(args.out)
    dl = out / "download"
    repacked = out / ("repacked-no-fa3" if args.no_fa3 else "repacked")
    missing = [q for q in SHIP if not kit._has(dl, q)]
    if missing:
        download(missing, dl)
    sources = {q: kit.find_wheel(dl, q) for q in SHIP}
    problems = check_closure(list(sources.values()))
    if problems:
        raise SystemExit(f"{len(problems)} unresolved requirements (see ERROR lines)")
    print(
        f"closure: every requirement of the {len(SHIP)} wheels is shipped, on the image or "
        "left out on purpose"
    )
    if args.check_only:
        return 0
    repacked.mkdir(parents=True, exist_ok=True)
    wheels, rows = [], []
    for pin, src in sources.items():
        key = norm(pin.split("==")[0]).replace("-", "_")
        path = src
        drops = DROPS.get(key, ()) + ((NO_FA3,) if args.no_fa3 and key == "sglang_kernel" else ())
        if drops:
            path = repacked / src.name
            if not path.exists() or path.stat().st_mtime < src.stat().st_mtime:
                print(f"  repacking {src.name}")
                repack(src, path, drops)
        wheels.append(Wheel(path, "keep"))
        rows.append((src.name, src.stat().st_size, path.stat().st_size))
    manifest = kit.split_into_parts(wheels, out, int(args.part_mib * MiB))
    manifest["what"] = (
        "SGLang 0.5.17 lean wheel set for Python 3.12 / torch 2.11.0 + CUDA 13 on sm_90 (codraft)"
        + (", without FA3: serve with --attention-backend flashinfer" if args.no_fa3 else "")
    )
    manifest["fa3"] = not args.no_fa3
    # install.sh checks the installed set's requirements against these (left out on purpose)
    manifest["left_out"] = LEFT_OUT
    manifest["accepted"] = ACCEPTED
    text = json.dumps(manifest, indent=1)
    for name in manifest["parts"]:
        (out / name / "manifest.json").write_text(text)
    (out / "manifest.json").write_text(text)
    for name, before, after in sorted(rows, key=lambda r: -r[2]):
        was = f" (was {before / MiB:.1f})" if before != after else ""
        print(f"  {after / MiB:8.2f} MiB  {name}{was}")
    kit.print_parts(manifest, out, len(wheels))
    return 0


if __name__ == "__main__":
    sys.exit(main())
