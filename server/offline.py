"""One offline vLLM run ("arm"): a target, optionally an EAGLE-3 draft, a batch of prompts.

Runs in its own process (`python -m codraft.server.offline SPEC.json OUT.json`) so that arms never
share an engine's memory or state; `run_arm_subprocess` is the caller's side. The result holds every
request's output token ids, timing and vLLM's speculative-decoding counters, from which the mean
acceptance length (tokens per verification step) follows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class ArmSpec:
    target: str
    prompts: list[str]
    draft: str | None = None
    num_speculative_tokens: int = 3
    max_tokens: int = 64
    chat: bool = False  # apply the target's chat template to each prompt
    dtype: str = "float32"
    max_model_len: int = 2048
    max_num_seqs: int = 16
    seed: int = 0
    ignore_eos: bool = False
    method: str = "eagle3"  # vLLM's speculative method for the draft: "eagle3" or "dflash"


@dataclass
class ArmResult:
    spec: ArmSpec
    token_ids: list[list[int]]
    texts: list[str]
    load_s: float
    generate_s: float
    output_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    prompt_token_ids: list[list[int]] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.generate_s if self.generate_s > 0 else 0.0

    @property
    def acceptance_length(self) -> float:
        """Mean tokens emitted per verification step (1 + accepted drafts per step)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def to_json(self) -> dict:
        d = asdict(self)
        d["tokens_per_s"] = self.tokens_per_s
        d["acceptance_length"] = self.acceptance_length
        return d

    @classmethod
    def from_json(cls, d: dict) -> ArmResult:
        d = {k: v for k, v in d.items() if k not in ("tokens_per_s", "acceptance_length")}
        d["spec"] = ArmSpec(**d["spec"])
        return cls(**d)


def _spec_counters(llm) -> dict[str, object]:
    out: dict[str, object] = {}
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_drafts":
            out["num_drafts"] = int(m.value)
        elif m.name == "vllm:spec_decode_num_draft_tokens":
            out["num_draft_tokens"] = int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens":
            out["num_accepted_tokens"] = int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            out["accepted_per_pos"] = [int(v) for v in m.values]
    return out


def _minus(after: object, before: object) -> object:
    if before is None:
        return after
    if isinstance(after, list):
        return [a - b for a, b in zip(after, before, strict=True)]
    return after - before


def run_arm(spec: ArmSpec) -> ArmResult:
    """Run one arm in this process (vLLM must not have been initialised here before)."""
    from codraft.server.vllm_env import apply_cpu_defaults

    apply_cpu_defaults()
    from vllm import LLM, SamplingParams

    kwargs: dict = {}
    if spec.draft:
        kwargs["speculative_config"] = {
            "method": spec.method,
            "model": spec.draft,
            "num_speculative_tokens": spec.num_speculative_tokens,
        }
    t0 = time.perf_counter()
    llm = LLM(
        model=spec.target,
        dtype=spec.dtype,
        enforce_eager=True,
        max_model_len=spec.max_model_len,
        max_num_seqs=spec.max_num_seqs,
        seed=spec.seed,
        disable_log_stats=False,
        **kwargs,
    )
    load_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=spec.max_tokens, ignore_eos=spec.ignore_eos)
    prompts = spec.prompts
    if spec.chat:
        tok = llm.get_tokenizer()
        prompts = [
            tok.apply_chat_template(
                [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
            )
            for p in prompts
        ]
    # Warm-up (first-call allocations, thread pools), excluded from timing and counters.
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    before = _spec_counters(llm)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    generate_s = time.perf_counter() - t0
    after = _spec_counters(llm)
    counters = {k: _minus(v, before.get(k)) for k, v in after.items()}
    token_ids = [list(o.outputs[0].token_ids) for o in outs]
    return ArmResult(
        spec=spec,
        token_ids=token_ids,
        texts=[o.outputs[0].text for o in outs],
        load_s=load_s,
        generate_s=generate_s,
        output_tokens=sum(len(t) for t in token_ids),
        prompt_token_ids=[list(o.prompt_token_ids or []) for o in outs],
        **counters,
    )


def run_arm_subprocess(spec: ArmSpec, workdir: Path, *, timeout: float = 1800) -> ArmResult:
    """Run `spec` in a fresh Python process and return its result."""
    from codraft.server.vllm_env import preload_env

    workdir.mkdir(parents=True, exist_ok=True)
    name = f"arm-{time.time_ns()}"
    spec_path, out_path = workdir / f"{name}.spec.json", workdir / f"{name}.result.json"
    spec_path.write_text(json.dumps(asdict(spec)))
    env = preload_env()
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    proc = subprocess.run(
        [sys.executable, "-m", "codraft.server.offline", str(spec_path), str(out_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0 or not out_path.exists():
        tail = (proc.stdout + proc.stderr)[-4000:]
        raise RuntimeError(f"vLLM arm failed (exit {proc.returncode}); its output ends:\n{tail}")
    return ArmResult.from_json(json.loads(out_path.read_text()))


def _main(argv: list[str]) -> int:
    spec_path, out_path = argv
    spec = ArmSpec(**json.loads(Path(spec_path).read_text()))
    result = run_arm(spec)
    tmp = Path(out_path).with_suffix(".tmp")
    tmp.write_text(json.dumps(result.to_json()))
    os.replace(tmp, out_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
