"""The teacher: target distributions for the draft to learn, from the target itself.

Streamed mode: the server streams each token's final hidden state, taken after the target's
final norm (the lm_head's input; tap message schema 2); the teacher holds only the target's
lm_head (read from the model folder without loading any decoder layer or norm; tied embeddings
mean lm_head = embed_tokens) and turns hidden states into logits = lm_head(last_hidden).
Recompute mode: the server streams token ids only; the teacher runs the whole `TargetModel` on
one device over a packed batch to get taps, last hidden (post-norm, as streamed) and logits.

Everything runs under no_grad and in chunks of `chunk_tokens` rows, so the [chunk, V] logits are
the only vocabulary-sized temporaries. Hidden states are cast to the head's dtype first, so the
result is `TargetModel.head` of a model loaded with the same dtype: bit for bit when a chunk holds
all the rows (BLAS picks kernels by row count, so other chunkings can differ by an ulp).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from codraft.learner.data.packing import PackedBatch
from codraft.models.config import TargetConfig
from codraft.models.llama import TargetModel, TargetOutput, load_target, safetensors_files


def _find_tensor(path: Path, names: Sequence[str]) -> tuple[Path, str] | None:
    """(file, key) of the first of `names` stored in the model folder, reading headers only."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        for name in names:
            if name in weight_map:
                return path / weight_map[name], name
        return None
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as sf:
            keys = set(sf.keys())
        for name in names:
            if name in keys:
                return file, name
    return None


def _read_tensor(path: Path, names: Sequence[str], shape: tuple[int, ...]) -> torch.Tensor:
    found = _find_tensor(path, names)
    if found is None:
        raise ValueError(
            f"none of {list(names)} is in the weights of {path}; is this a Llama-family "
            "transformers folder?"
        )
    file, key = found
    with safe_open(str(file), framework="pt") as sf:
        t = sf.get_tensor(key)
    if tuple(t.shape) != shape:
        raise ValueError(f"{key} in {file.name} has shape {tuple(t.shape)}, expected {shape}")
    return t


def load_head(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    *,
    config: TargetConfig | None = None,
) -> nn.Linear:
    """The target's lm_head alone (the embeddings when they are tied), read from a transformers
    model folder (`config`: its config.json, when already read). No final norm: the hidden states
    it is applied to are taken after it."""
    path = Path(path)
    cfg = config if config is not None else TargetConfig.from_pretrained(path)
    H, V = cfg.hidden_size, cfg.vocab_size
    head_names = ("lm_head.weight",)
    if cfg.tie_word_embeddings:
        head_names = ("model.embed_tokens.weight", "embed_tokens.weight")
    head_w = _read_tensor(path, head_names, (V, H))
    with torch.device("meta"):
        head = nn.Linear(H, V, bias=False)
    head.weight = nn.Parameter(head_w.to(device=device, dtype=dtype), requires_grad=False)
    return head.eval()


class Teacher:
    """Teacher logits and draft-vocab targets from the target's lm_head (and body in recompute).

    Build with `from_pretrained(path)` (streamed; recompute=True loads the whole target),
    `from_model(model)` (recompute, sharing the model's own lm_head) or `Teacher(lm_head)`.
    Every hidden state given to it is a final one, after the target's final norm.
    """

    def __init__(
        self,
        lm_head: nn.Linear,
        *,
        target: TargetModel | None = None,
        chunk_tokens: int = 1024,
    ) -> None:
        if not isinstance(lm_head, nn.Linear):
            raise TypeError(
                f"Teacher takes the target's lm_head (an nn.Linear [V, H]), got "
                f"{type(lm_head).__name__}; it holds no final norm: the hidden states it is "
                "given are taken after the target's final norm"
            )
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        self.lm_head, self.target = lm_head, target
        self.chunk_tokens = chunk_tokens
        self._draft_cache: tuple[torch.Tensor, torch.Tensor] | None = None  # (t2d, rows of W)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        recompute: bool = False,
        chunk_tokens: int = 1024,
        config: TargetConfig | None = None,
    ) -> Teacher:
        """`config`: the folder's config.json, when the caller has read it already."""
        if recompute:
            model = load_target(path, dtype, device, config=config)
            return cls.from_model(model, chunk_tokens=chunk_tokens)
        return cls(load_head(path, dtype, device, config=config), chunk_tokens=chunk_tokens)

    @classmethod
    def from_model(cls, model: TargetModel, *, chunk_tokens: int = 1024) -> Teacher:
        return cls(model.lm_head, target=model, chunk_tokens=chunk_tokens)

    @property
    def mode(self) -> str:
        return "streamed" if self.target is None else "recompute"

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def vocab_size(self) -> int:
        return self.lm_head.weight.shape[0]

    def _check_hidden(self, last_hidden: torch.Tensor) -> torch.Tensor:
        H = self.lm_head.weight.shape[1]
        if last_hidden.shape[-1] != H:
            raise ValueError(
                f"last_hidden has width {last_hidden.shape[-1]}, the target's hidden size is {H}: "
                "stream the final hidden state [N, H], not the taps"
            )
        return last_hidden.reshape(-1, H)

    @torch.no_grad()
    def iter_logits(self, last_hidden: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
        """(start row, logits [chunk, V]) over the rows of last_hidden [..., H] (post-norm),
        in order."""
        h = self._check_hidden(last_hidden)
        for a in range(0, len(h), self.chunk_tokens):
            x = h[a : a + self.chunk_tokens].to(device=self.device, dtype=self.dtype)
            yield a, self.lm_head(x)

    @torch.no_grad()
    def logits(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """lm_head of final (post-norm) hidden states [..., H] -> logits [..., V]."""
        out = torch.empty(
            *last_hidden.shape[:-1], self.vocab_size, device=self.device, dtype=self.dtype
        )
        flat = out.view(-1, self.vocab_size)
        for a, chunk in self.iter_logits(last_hidden):
            flat[a : a + len(chunk)] = chunk
        return out

    def _draft_rows(self, t2d: torch.Tensor) -> torch.Tensor:
        if t2d.dtype != torch.bool or t2d.shape != (self.vocab_size,):
            raise ValueError(
                f"t2d must be a bool mask over the target vocab [{self.vocab_size}], got "
                f"{t2d.dtype} {list(t2d.shape)}"
            )
        t2d = t2d.to(self.device)
        cached = self._draft_cache
        if cached is None or not torch.equal(cached[0], t2d):
            cached = (t2d.clone(), self.lm_head.weight[t2d].contiguous())
            self._draft_cache = cached
        return cached[1]

    @torch.no_grad()
    def draft_logits(self, last_hidden: torch.Tensor, t2d: torch.Tensor) -> torch.Tensor:
        """The target's logits of the draft vocab, target_logits[..., t2d], in the head's dtype
        [..., Vd], for final (post-norm) hidden states [..., H]: only those rows of lm_head
        are computed. What the TTT loss trains against (it takes their softmax)."""
        w = self._draft_rows(t2d)
        h = self._check_hidden(last_hidden)
        out = torch.empty(len(h), w.shape[0], device=self.device, dtype=self.dtype)
        for a in range(0, len(h), self.chunk_tokens):
            x = h[a : a + self.chunk_tokens].to(device=self.device, dtype=self.dtype)
            out[a : a + len(x)] = F.linear(x, w)
        return out.view(*last_hidden.shape[:-1], w.shape[0])

    # ------------------------------------------------------------------ recompute
    def _need_target(self) -> TargetModel:
        if self.target is None:
            raise RuntimeError(
                "this teacher holds the target head only (streamed mode); build it with "
                "Teacher.from_pretrained(path, recompute=True) or Teacher.from_model(model)"
            )
        return self.target

    @torch.no_grad()
    def recompute(
        self, batch: PackedBatch, tap_layers: Sequence[int], *, return_logits: bool = False
    ) -> TargetOutput:
        """Run the target over a packed batch: taps [N, n_taps*H], last_hidden [N, H] (after the
        final norm, like a streamed one) and, when asked, logits [N, V] (computed in chunks)."""
        model = self._need_target()
        dev = self.device
        out = model(
            batch.input_ids.to(dev),
            positions=batch.positions.to(dev),
            tap_layers=tap_layers,
            return_logits=False,
            cu_seqlens=batch.cu_seqlens.to(dev),
        )
        if return_logits:
            out.logits = self.logits(out.last_hidden)
        return out

    @torch.no_grad()
    def fill(self, batch: PackedBatch, tap_layers: Sequence[int]) -> PackedBatch:
        """The batch with taps and last_hidden recomputed (zero on padding, like `pack`)."""
        out = self.recompute(batch, tap_layers)
        pad = ~batch.valid.to(self.device)[:, None]
        return replace(
            batch,
            taps=out.taps.masked_fill(pad, 0),
            last_hidden=out.last_hidden.masked_fill(pad, 0),
        )


def load_embedding(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    *,
    config: TargetConfig | None = None,
) -> torch.Tensor:
    """The target's token embedding [V, H] alone (the EAGLE-3 draft shares it, frozen;
    `config`: the folder's config.json, when already read)."""
    path = Path(path)
    cfg = config if config is not None else TargetConfig.from_pretrained(path)
    w = _read_tensor(
        path,
        ("model.embed_tokens.weight", "embed_tokens.weight"),
        (cfg.vocab_size, cfg.hidden_size),
    )
    return w.to(device=device, dtype=dtype)
