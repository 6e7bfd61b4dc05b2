"""Static check of codraft's SGLang touch points against SGLang's source, on any machine.

SGLang's modules do not import without its CUDA kernels, so this reads the source (the wheel
unpacked) with `ast` and checks what codraft's SGLang engine (codraft.server.sglang) relies on:

1. every hook target of `codraft.server.sglang.plugin.HOOKS` exists (module, class, method);
2. the hooked methods take their arguments where the hooks read them (e.g. the logits
   processor's hidden states second and captured layers fifth; the scheduler's
   `process_batch_result(batch, result)`);
3. SGLang's Llama hands the logits processor five positional arguments, the last its captured
   layers, and its model keeps `layers_to_capture`;
4. the attributes the engine reads are set where it reads them (the request's prompt and
   output ids, the batch's extend lengths, the verify result's accepted lengths, the EAGLE
   worker's target and draft, the model runner's dtype, device, weight updater, ...).

    .venv/bin/python scripts/gpu_sglang/check_sglang_src.py --src sglang-0.5.17-*.whl

(the wheel, or a folder it was unpacked into; tests/test_sglang_engine.py downloads it.) Exit
status 1, naming each problem, when anything is missing.
"""

from __future__ import annotations

import argparse
import ast
import sys
import zipfile
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_WEIGHTS = "sglang.srt.managers.scheduler_components.weight_updater"

# (module, class, method): the positional parameter names (after self) the hooks rely on
SIGNATURES = {
    ("sglang.srt.layers.logits_processor", "LogitsProcessor", "forward"): (
        "input_ids", "hidden_states", "lm_head", "logits_metadata", "aux_hidden_states",
    ),
    ("sglang.srt.model_executor.model_runner", "ModelRunner", "forward"): ("forward_batch",),
    ("sglang.srt.speculative.eagle_worker_v2", "EAGLEWorkerV2", "forward_batch_generation"): (
        "batch",
    ),
    ("sglang.srt.speculative.dflash_worker_v2", "DFlashWorkerV2", "forward_batch_generation"): (
        "batch",
    ),
    ("sglang.srt.managers.scheduler", "Scheduler", "process_batch_result"): ("batch", "result"),
    (_WEIGHTS, "SchedulerWeightUpdaterManager", "release_memory_occupation"): ("recv_req",),
    (_WEIGHTS, "SchedulerWeightUpdaterManager", "resume_memory_occupation"): ("recv_req",),
    ("sglang.srt.speculative.eagle_worker_v2", "EAGLEWorkerV2", "update_weights_from_tensor"): (
        "recv_req",
    ),
}  # fmt: skip

# (module, class): attributes codraft reads, set on `self` in a method or declared in the body
ATTRIBUTES = {
    ("sglang.srt.managers.schedule_batch", "Req"): (
        "rid", "origin_input_ids", "output_ids", "finished",
    ),
    ("sglang.srt.managers.schedule_batch", "ScheduleBatch"): (
        "reqs", "forward_mode", "extend_lens", "is_extend_in_batch",
    ),
    ("sglang.srt.managers.utils", "GenerationBatchResult"): ("logits_output", "accept_lens"),
    ("sglang.srt.layers.logits_processor", "LogitsProcessorOutput"): ("hidden_states",),
    ("sglang.srt.model_executor.forward_batch_info", "ForwardBatch"): (
        "input_ids", "positions", "forward_mode", "batch_size", "spec_info",
    ),  # fmt: skip
    ("sglang.srt.model_executor.forward_batch_info", "ForwardMode"): (
        "is_extend", "is_target_verify",
    ),  # fmt: skip
    ("sglang.srt.speculative.eagle_info", "EagleVerifyInput"): ("draft_token_num",),
    ("sglang.srt.speculative.dflash_info", "DFlashVerifyInput"): (
        "draft_token_num", "ragged_verify_layout",
    ),  # fmt: skip
    ("sglang.srt.speculative.ragged_verify", "RaggedVerifyLayout"): (
        "verify_lens", "verify_lens_cpu",
    ),  # fmt: skip
    ("sglang.srt.model_executor.model_runner", "ModelRunner"): (
        "model", "is_draft_worker", "dtype", "device", "gpu_id", "model_config",
        "weight_updater", "load_model",
    ),
    ("sglang.srt.speculative.eagle_worker_v2", "EAGLEWorkerV2"): (
        "target_worker", "draft_worker",
    ),
    ("sglang.srt.speculative.eagle_worker_v2", "EagleDraftWorker"): ("draft_runner",),
    ("sglang.srt.speculative.dflash_worker_v2", "DFlashWorkerV2"): (
        "target_worker", "draft_model",
    ),
    ("sglang.srt.managers.scheduler", "Scheduler"): (
        "draft_worker", "server_args", "process_input_requests", "is_fully_idle", "flush_cache",
    ),
    ("sglang.srt.models.llama", "LlamaModel"): ("layers_to_capture",),
    ("sglang.srt.models.llama_eagle3", "LlamaForCausalLMEagle3"): ("load_weights",),
    ("sglang.srt.model_executor.model_runner_components.weight_updater", "WeightUpdater"): (
        "update_weights_from_disk",
    ),
    ("sglang.srt.managers.tp_worker", "TpModelWorker"): ("update_weights_from_tensor",),
    ("sglang.srt.managers.io_struct", "ReleaseMemoryOccupationReqInput"): ("tags",),
    ("sglang.srt.managers.io_struct", "ResumeMemoryOccupationReqInput"): ("tags",),
    ("sglang.srt.managers.io_struct", "UpdateWeightFromDiskReqOutput"): ("success",),
    ("sglang.srt.managers.io_struct", "UpdateWeightsFromTensorReqOutput"): ("success",),
    ("sglang.srt.managers.io_struct", "UpdateWeightsFromDistributedReqOutput"): ("success",),
    ("sglang.srt.managers.io_struct", "UpdateWeightsFromIPCReqOutput"): ("success",),
    ("sglang.srt.server_args", "ServerArgs"): (
        "model_path", "speculative_eagle_topk", "tp_size", "pp_size", "disable_radix_cache",
        "add_cli_args", "from_cli_args", "tokenizer_worker_num", "enable_http2",
    ),
}  # fmt: skip

# module-level functions `codraft serve --engine sglang` calls, and the keyword it passes
FUNCTIONS = {
    ("sglang.srt.entrypoints.http_server", "launch_server"): ("launch_callback",),
}


class Source:
    """SGLang's modules from an unpacked wheel (a folder holding sglang/) or the wheel itself."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.wheel = zipfile.ZipFile(root) if root.suffix == ".whl" else None

    def _read(self, rel: str) -> str | None:
        if self.wheel is not None:
            try:
                return self.wheel.read(rel).decode()
            except KeyError:
                return None
        path = self.root / rel
        return path.read_text() if path.is_file() else None

    @cache  # noqa: B019 (one Source per run)
    def module(self, name: str) -> ast.Module | None:
        base = "/".join(name.split("."))
        text = self._read(f"{base}.py") or self._read(f"{base}/__init__.py")
        return ast.parse(text) if text is not None else None

    def cls(self, module: str, name: str) -> ast.ClassDef | None:
        tree = self.module(module)
        if tree is None:
            return None
        found = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name]
        return found[0] if found else None

    def bases(self, module: str, c: ast.ClassDef, depth: int = 4) -> list[ast.ClassDef]:
        """The class's bases defined in SGLang (same module or imported by name), recursively."""
        out: list[ast.ClassDef] = []
        tree = self.module(module)
        imported = {
            a.asname or a.name: n.module
            for n in (tree.body if tree else []) if isinstance(n, ast.ImportFrom) and n.module
            for a in n.names
        }  # fmt: skip
        for b in c.bases:
            if not isinstance(b, ast.Name) or depth == 0:
                continue
            where = module if self.cls(module, b.id) is not None else imported.get(b.id)
            found = self.cls(where, b.id) if where else None
            if found is not None:
                out += [found, *self.bases(where, found, depth - 1)]
        return out


def methods(c: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in c.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}


def attributes(c: ast.ClassDef) -> set[str]:
    """Names a class declares (fields, methods, class attributes) or sets on `self`."""
    out = set(methods(c))
    for n in c.body:
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            out.add(n.target.id)
        elif isinstance(n, ast.Assign):
            out |= {t.id for t in n.targets if isinstance(t, ast.Name)}
    for n in ast.walk(c):
        targets = n.targets if isinstance(n, ast.Assign) else [getattr(n, "target", None)]
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name):
                if t.value.id == "self":
                    out.add(t.attr)
    return out


def positional(f: ast.FunctionDef) -> list[str]:
    return [a.arg for a in [*f.args.posonlyargs, *f.args.args]][1:]


def check(src: Source) -> list[str]:
    from codraft.server.sglang.plugin import HOOKS

    problems = []
    for target, _hook, _kind in HOOKS:
        module, cls_name, meth = target.rsplit(".", 2)
        c = src.cls(module, cls_name)
        if c is None:
            problems.append(f"hook target {target}: no class {cls_name} in {module}")
        elif meth not in methods(c):
            problems.append(f"hook target {target}: {cls_name} has no method {meth}")
    for (module, cls_name, meth), want in SIGNATURES.items():
        c = src.cls(module, cls_name)
        f = methods(c).get(meth) if c is not None else None
        got = positional(f)[: len(want)] if f is not None else None
        if got != list(want):
            problems.append(f"{cls_name}.{meth}: positional parameters {got}, codraft reads {want}")
    for (module, cls_name), names in ATTRIBUTES.items():
        c = src.cls(module, cls_name)
        if c is None:
            problems.append(f"no class {cls_name} in {module}")
            continue
        have = attributes(c)
        for base in src.bases(module, c):  # SGLang's own base classes and mixins
            have |= attributes(base)
        missing = [n for n in names if n not in have]
        if missing:
            problems.append(f"{cls_name} ({module}) sets none of {missing} codraft reads")
    for (module, fn), kwargs in FUNCTIONS.items():
        tree = src.module(module)
        f = next((n for n in (tree.body if tree else []) if isinstance(n, ast.FunctionDef)
                  and n.name == fn), None)  # fmt: skip
        params = {a.arg for a in [*f.args.args, *f.args.kwonlyargs]} if f else set()
        if f is None or not set(kwargs) <= params:
            problems.append(f"{module}.{fn}: no such function taking {kwargs}")
    problems += check_llama(src)
    return problems


def check_llama(src: Source) -> list[str]:
    """LlamaForCausalLM.forward calls self.logits_processor(input_ids, hidden_states, lm_head,
    forward_batch, aux_hidden_states): the final (normed) state second, the captures fifth."""
    c = src.cls("sglang.srt.models.llama", "LlamaForCausalLM")
    f = methods(c).get("forward") if c is not None else None
    if f is None:
        return ["sglang.srt.models.llama: no LlamaForCausalLM.forward"]
    calls = [
        n for n in ast.walk(f) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
        and n.func.attr == "logits_processor"
    ]  # fmt: skip
    shapes = [[ast.unparse(a) for a in n.args] for n in calls]
    if not any(len(s) == 5 and s[1] == "hidden_states" and s[4] == "aux_hidden_states"
               for s in shapes):  # fmt: skip
        return [f"LlamaForCausalLM.forward calls logits_processor with {shapes}"]
    return []


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--src", required=True, help="sglang's wheel, or a folder holding sglang/")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    problems = check(Source(Path(args.src)))
    for line in problems:
        print(f"  MISSING {line}")
    print(f"{len(problems)} problem(s) against {args.src}")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
