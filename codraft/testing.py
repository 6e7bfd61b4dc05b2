"""Tiny random target models for tests and demos, built offline.

`make_tiny_target(out_dir, arch=...)` writes a normal transformers folder (config.json,
model.safetensors, generation_config.json, tokenizer files with a ChatML chat template) that
transformers' Auto classes and vLLM load without any network. The tokenizer is a byte-level BPE
trained on a small built-in English/maths corpus, with exactly `vocab_size` tokens.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

STAMP_FILE = "codraft_tiny.json"
STAMP_VERSION = 2
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
ARCHES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}

_PROSE = """\
The quick brown fox jumps over the lazy dog. A small model learns to guess the next word.
Speculative decoding lets a small draft propose several tokens, and the large target model
checks them all at once. When the draft guesses right, the answer comes out faster, and it is
exactly the same answer the target would have written on its own.
Once upon a time there was a little robot who liked to count. Every morning it counted the
birds in the garden, the clouds in the sky and the steps from the door to the gate.
The weather today is sunny with a light breeze. Tomorrow it may rain in the afternoon, so take
an umbrella if you go for a walk in the park.
Question: What is the capital of France? Answer: The capital of France is Paris.
Question: How many days are there in a week? Answer: There are seven days in a week.
Question: Which planet is known as the red planet? Answer: Mars is known as the red planet.
User: Can you help me write a short poem about the sea?
Assistant: Of course. The sea is wide, the sea is deep, it sings the sailors off to sleep.
User: Please explain what a prime number is.
Assistant: A prime number is a whole number greater than one whose only divisors are one and
itself. For example, two, three, five, seven and eleven are prime numbers.
def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, i))
Tom has 12 apples. He gives 5 apples to Anna and buys 7 more. How many apples does Tom have
now? Tom has 12 - 5 + 7 = 14 apples. The answer is 14.
A train travels 60 kilometres per hour for 3 hours. How far does it travel? It travels
60 * 3 = 180 kilometres. The answer is 180.
Sara reads 15 pages every day. How many pages does she read in 4 days? She reads
15 * 4 = 60 pages. The answer is 60.
The sum of the angles of a triangle is 180 degrees. The area of a rectangle is its length
times its width. The square of a number is the number multiplied by itself.
"""


def _corpus() -> list[str]:
    """Built-in training text: prose above plus generated arithmetic (deterministic)."""
    rng = random.Random(1234)
    lines = _PROSE.splitlines()
    names = ["Tom", "Anna", "Sara", "Ben", "Lena", "Omar", "Mia", "Jack"]
    things = ["apples", "books", "coins", "marbles", "pencils", "cookies", "stickers"]
    for _ in range(400):
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        op = rng.choice("+-*")
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        name, thing = rng.choice(names), rng.choice(things)
        lines.append(f"{a} {op} {b} = {value}")
        lines.append(
            f"{name} has {a} {thing} and gets {b} more. Now {name} has {a} + {b} = {a + b} "
            f"{thing}. The answer is {a + b}."
        )
    return lines


def build_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE `PreTrainedTokenizerFast` with exactly `vocab_size` tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    floor = 256 + len(SPECIAL_TOKENS)
    if vocab_size < floor:
        raise ValueError(
            f"vocab_size {vocab_size} is too small for a byte-level tokenizer: need at least "
            f"{floor} (256 bytes + {len(SPECIAL_TOKENS)} special tokens)"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    # A small corpus may run out of merges before vocab_size: fill with reserved tokens.
    fill = vocab_size - tok.get_vocab_size()
    if fill > 0:
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(fill)])
    assert tok.get_vocab_size() == vocab_size, (tok.get_vocab_size(), vocab_size)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
    )


def save_tokenizer(tokenizer: Any, folder: Path) -> None:
    """save_pretrained, then make tokenizer_config.json readable by transformers 4 and 5 alike
    (generic tokenizer class name, chat template inline as well as in chat_template.jinja)."""
    tokenizer.save_pretrained(folder)
    cfg_file = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg_file.write_text(json.dumps(cfg, indent=2) + "\n")


@dataclass(frozen=True)
class TinySpec:
    """Everything that determines a tiny target; stored as the cache stamp."""

    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    seed: int
    tie_word_embeddings: bool
    dtype: str
    initializer_range: float
    version: int = STAMP_VERSION


def tiny_target_config(spec: TinySpec) -> Any:
    """The transformers config object for a `TinySpec`."""
    import transformers

    if spec.arch not in ARCHES:
        raise ValueError(f"unknown tiny arch {spec.arch!r}; expected one of {sorted(ARCHES)}")
    config_cls = getattr(transformers, ARCHES[spec.arch][0])
    kwargs: dict[str, Any] = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=2048,
        initializer_range=spec.initializer_range,
        rms_norm_eps=1e-6,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=0,
    )
    config = config_cls(**kwargs)
    config.architectures = [ARCHES[spec.arch][1]]
    return config


def make_tiny_target(
    out_dir: str | Path,
    arch: str = "llama",
    *,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 4,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    head_dim: int | None = None,
    intermediate_size: int = 128,
    seed: int = 0,
    tie_word_embeddings: bool = False,
    dtype: str = "float32",
    initializer_range: float = 0.1,
) -> Path:
    """Write a tiny random `arch` model + tokenizer into `out_dir` (cached by a stamp file).

    The defaults (H=64, 2 query heads sharing 1 KV head, so head_dim 32) are chosen for vLLM:
    its CPU attention supports head sizes 32..512 only, and its Qwen2 ignores `head_dim` (it
    always uses hidden_size // num_heads). head_dim None means hidden_size // num_heads. Biases
    (qwen2's q/k/v) and norm weights get random values too, so a mix-up in either shows in
    outputs. Returns `out_dir` as a Path.
    """
    if head_dim is None:
        head_dim = hidden_size // num_heads
    if arch == "qwen2" and head_dim * num_heads != hidden_size:
        raise ValueError(
            f"qwen2 needs head_dim * num_heads == hidden_size (vLLM's Qwen2 ignores head_dim); "
            f"got head_dim {head_dim} * {num_heads} heads != {hidden_size}: change num_heads"
        )
    spec = TinySpec(
        arch=arch,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        seed=seed,
        tie_word_embeddings=tie_word_embeddings,
        dtype=dtype,
        initializer_range=initializer_range,
    )
    out = Path(out_dir)
    if _is_cached(out, spec):
        return out
    config = tiny_target_config(spec)  # validates arch before any heavy work
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        _write_model(tmp, spec, config)
        save_tokenizer(build_tokenizer(vocab_size), tmp)
        (tmp / STAMP_FILE).write_text(json.dumps(asdict(spec), indent=2) + "\n")
        _install(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _is_cached(out: Path, spec: TinySpec) -> bool:
    stamp = out / STAMP_FILE
    needed = ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json")
    if not stamp.is_file() or not all((out / n).is_file() for n in needed):
        return False
    try:
        return json.loads(stamp.read_text()) == asdict(spec)
    except (OSError, json.JSONDecodeError):
        return False


def _write_model(folder: Path, spec: TinySpec, config: Any) -> None:
    import torch
    import transformers
    from transformers import GenerationConfig

    torch_dtype = getattr(torch, spec.dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"unknown dtype {spec.dtype!r}; use float32, bfloat16 or float16")
    model_cls = getattr(transformers, ARCHES[spec.arch][1])
    torch.manual_seed(spec.seed)
    model = model_cls(config)
    gen = torch.Generator().manual_seed(spec.seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * spec.initializer_range)
            elif "norm" in name:
                p.copy_(1.0 + torch.randn(p.shape, generator=gen) * 0.1)
    if getattr(config, "tie_word_embeddings", False):
        # Tie explicitly: whether the constructor ties can depend on transformers' global state
        # (in one process it saved an untied lm_head.weight after other models were loaded).
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    model = model.to(torch_dtype)
    model.config.dtype = spec.dtype
    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=2, pad_token_id=0)
    model.save_pretrained(folder, safe_serialization=True)
    if not (folder / "generation_config.json").is_file():
        model.generation_config.save_pretrained(folder)


def _install(tmp: Path, out: Path) -> None:
    """Move the finished files into `out`, the stamp last, so a partial folder never looks done."""
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()
    if not out.exists():
        os.replace(tmp, out)
        return
    out.mkdir(parents=True, exist_ok=True)
    stale = out / STAMP_FILE
    if stale.exists():
        stale.unlink()
    for f in sorted(tmp.iterdir(), key=lambda p: p.name == STAMP_FILE):
        os.replace(f, out / f.name)


# ---------------------------------------------------------------------------- agreeing pair
# A target that always predicts one token and a draft built to predict it: with a correct weight
# layout and vocab mapping nearly every proposal is accepted (vLLM or the offline estimator).
CONSTANT_TOKEN = 300


def make_constant_target(src: Path, dst: Path) -> Path:
    """Copy of `src` whose greedy next token is always CONSTANT_TOKEN.

    Every layer's o_proj and down_proj are zero, so the residual stream is the embedding; every
    embedding gets +4 in dimension 0, so the normed last hidden state is positive there; lm_head
    is zero except row CONSTANT_TOKEN, which reads dimension 0.
    """
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    w = load_file(str(src / "model.safetensors"))
    for name in w:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w[name] = torch.zeros_like(w[name])
    w["model.embed_tokens.weight"][:, 0] = 4.0
    head = torch.zeros_like(w["lm_head.weight"])
    head[CONSTANT_TOKEN, 0] = 10.0
    w["lm_head.weight"] = head
    save_file(w, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def make_agreeing_draft(target: Path, out: Path, *, misplace: bool = False) -> Path:
    """A draft that predicts CONSTANT_TOKEN whatever it is given (see make_constant_target).

    fc copies dimension 0 of the first tap (the embedding, +4) into h; the midlayer's o_proj and
    down_proj are zero, so every pass's prenorm keeps it; lm_head's row for CONSTANT_TOKEN reads it.
    The draft vocab is 64 scattered ids, so CONSTANT_TOKEN sits at a draft id with d2t != 0.
    """
    from codraft.draft.checkpoint import DraftMeta, save_draft
    from codraft.draft.init import new_draft
    from codraft.models.config import TargetConfig

    cfg = TargetConfig.from_pretrained(target)
    counts = torch.zeros(cfg.vocab_size, dtype=torch.int64)
    counts[torch.arange(5, cfg.vocab_size, 7)] = 1
    counts[CONSTANT_TOKEN] = 100
    model = new_draft(cfg, counts, draft_vocab_size=64)
    sd = model.state_dict()
    draft_id = int(torch.nonzero(model.draft_to_target_ids() == CONSTANT_TOKEN))
    assert int(model.d2t[draft_id]) != 0, "the test must exercise a non-zero d2t offset"
    with torch.no_grad():
        for name, t in sd.items():
            if name.endswith(("o_proj.weight", "down_proj.weight", "fc.weight", "lm_head.weight")):
                t.zero_()
        sd["fc.weight"][0, 0] = 1.0
        sd["lm_head.weight"][draft_id - 1 if misplace else draft_id, 0] = 10.0
    return save_draft(out, model, DraftMeta(version=1))


def greedy_reference(target: Any, prompts: list[list[int]], n: int) -> list[list[int]]:
    """`n` greedy tokens per prompt from codraft's own target model (a full forward per token:
    the independent reference a serving engine's greedy output is compared with)."""
    out = []
    with torch.no_grad():
        for p in prompts:
            seq = list(p)
            for _ in range(n):
                seq.append(int(target(torch.tensor([seq])).logits[0, -1].argmax()))
            out.append(seq[len(p) :])
    return out


def descendants(pid: int) -> list[int]:
    """Every process `pid` started, and theirs (from /proc; empty where there is none)."""
    try:
        children = [int(c) for task in Path(f"/proc/{pid}/task").iterdir()
                    for c in (task / "children").read_text().split()]  # fmt: skip
    except OSError:
        return []
    return children + [d for c in children for d in descendants(c)]


def kill_tree(proc: Any) -> None:
    """SIGKILL a `subprocess.Popen` and everything it started (workers in sessions of their
    own, vLLM's engine core, the tap process would outlive it), then reap it."""
    import signal

    for pid in [*descendants(proc.pid), proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def stop_tree(proc: Any, timeout: float = 60.0) -> None:
    """SIGTERM a `subprocess.Popen` (None or an exited one: nothing); `kill_tree` it if it has
    not exited within `timeout` seconds."""
    import signal
    import subprocess

    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
