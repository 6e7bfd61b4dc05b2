"""One pipeline stage of the target: a contiguous run of decoder layers, the token embeddings on
stage 0 and the final norm + lm_head on the last stage.

Every stage but the last hands on the residual stream after its last layer; the last stage
applies the final norm to it and hands on the target's final hidden state (`last_hidden`, post-
norm, the same as `TargetModel`'s and as a streamed tap message's), whose logits `head`, the
lm_head alone, computes.

The split is applied from outside to the plain `TargetModel` (its pieces `embed`, `rope`,
`layers[i]`, `head`): `TargetStage.from_model` shares a loaded model's modules (tests, one
process holding everything), `load_stage` reads only this stage's tensors from a transformers
folder (a real run, where no process holds the whole target).

Parameter names stay the target's (`layers.5.mlp.up_proj.weight`, `norm.weight`), so a stage's
state dict is a slice of the model's.

Taps (docs/architecture.md, Contracts): tap k is the residual stream after k decoder layers, before
any final norm (tap L too). It is made on the stage that runs layer k (0-based layer index k-1); tap
0, the embeddings, on stage 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from codraft.models.config import TargetConfig, validate_tap_layers
from codraft.models.layers import RMSNorm, RotaryEmbedding
from codraft.models.llama import TargetModel, safetensors_files


def split_layers(num_layers: int, num_stages: int) -> list[range]:
    """Contiguous layer ranges, one per stage, balanced by layer count.

    Every stage gets num_layers // num_stages layers; the remainder goes one each to the middle
    stages first (stage 0 also embeds, the last stage also runs the head and the draft), then
    to stage 0, then to the last stage.
    """
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_layers < num_stages:
        raise ValueError(
            f"cannot split a {num_layers}-layer target over {num_stages} pipeline stages: every "
            f"stage needs at least one layer; use --pp {num_layers} or fewer"
        )
    counts = [num_layers // num_stages] * num_stages
    order = list(range(1, num_stages - 1)) + [0, num_stages - 1]
    for s in order[: num_layers % num_stages]:
        counts[s] += 1
    ranges, lo = [], 0
    for n in counts:
        ranges.append(range(lo, lo + n))
        lo += n
    return ranges


def tap_stage(tap: int, ranges: Sequence[range]) -> int:
    """The stage that makes tap `tap` (the residual stream after `tap` layers)."""
    if tap == 0:
        return 0
    for s, r in enumerate(ranges):
        if tap - 1 in r:
            return s
    raise ValueError(f"tap {tap} is after none of the layers {[list(r) for r in ranges]}")


def taps_by_stage(tap_layers: Sequence[int], ranges: Sequence[range]) -> list[list[int]]:
    """For each stage, the taps it makes, in the order they appear in `tap_layers`."""
    out: list[list[int]] = [[] for _ in ranges]
    for t in tap_layers:
        out[tap_stage(t, ranges)].append(t)
    return out


class TargetStage(nn.Module):
    """Layers `layer_range` of the target; `embed_tokens` on stage 0, `norm` and `lm_head` on the
    last stage. Forward-only: build it frozen (`requires_grad_(False)`) and call under no_grad."""

    def __init__(
        self,
        config: TargetConfig,
        index: int,
        num_stages: int,
        layer_range: range,
        layers: Sequence[nn.Module],
        rotary: RotaryEmbedding,
        embed_tokens: nn.Embedding | None = None,
        norm: RMSNorm | None = None,
        lm_head: nn.Linear | None = None,
    ) -> None:
        super().__init__()
        if not 0 <= index < num_stages:
            raise ValueError(f"stage index {index} is not in 0..{num_stages - 1}")
        if len(layers) != len(layer_range):
            raise ValueError(f"{len(layers)} layers given for layer range {layer_range}")
        self.config, self.index, self.num_stages = config, index, num_stages
        self.layer_range = layer_range
        self.embed_tokens = embed_tokens
        self.layers = nn.ModuleDict({str(i): m for i, m in zip(layer_range, layers, strict=True)})
        self.norm, self.lm_head = norm, lm_head
        self.__dict__["rotary"] = rotary  # not a submodule: its tables never change dtype
        if self.is_first and embed_tokens is None:
            raise ValueError("stage 0 needs the token embeddings")
        if self.is_last and (norm is None or lm_head is None):
            raise ValueError("the last stage needs the final norm and lm_head")

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    @classmethod
    def from_model(
        cls, model: TargetModel, index: int, num_stages: int, ranges: Sequence[range] | None = None
    ) -> TargetStage:
        """Stage `index` of `model`, sharing its modules (no copy)."""
        ranges = list(ranges or split_layers(model.config.num_layers, num_stages))
        r = ranges[index]
        last = index == num_stages - 1
        return cls(
            model.config,
            index,
            num_stages,
            r,
            [model.layers[i] for i in r],
            model.rotary_emb,
            embed_tokens=model.embed_tokens if index == 0 else None,
            norm=model.norm if last else None,
            lm_head=model.lm_head if last else None,
        )

    def makes(self, tap_layers: Sequence[int]) -> list[int]:
        """The taps of `tap_layers` made on this stage, in their order there."""
        lo, hi = self.layer_range.start, self.layer_range.stop
        return [t for t in tap_layers if lo < t <= hi or (t == 0 and self.is_first)]

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cu_seqlens: torch.Tensor,
        tap_layers: Sequence[int] = (),
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Run this stage over one packed microbatch.

        x: token ids [N] on stage 0, else the previous stage's hidden states [N, H].
        Returns (hidden [N, H], {tap: [N, H]} for the taps of `tap_layers` made here). The hidden
        state is the residual stream after this stage's last layer, except on the last stage:
        there it is the final norm of it, the target's post-norm `last_hidden` (the taps stay
        pre-norm).
        """
        wanted = set(validate_tap_layers(tap_layers, self.config.num_layers))
        if self.is_first:
            h = self.embed_tokens(x)[None]
        else:
            h = x[None]
        cos, sin = self.rotary(positions[None], h.dtype)
        taps: dict[int, torch.Tensor] = {}
        if self.is_first and 0 in wanted:
            taps[0] = h[0]
        for i, layer in zip(self.layer_range, self.layers.values(), strict=True):
            h = layer(h, cos, sin, cu_seqlens)
            if i + 1 in wanted:
                taps[i + 1] = h[0]
        if self.is_last:
            h = self.norm(h)
        return h[0], taps

    def head(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """The lm_head alone (last stage only): final (post-norm) hidden states [..., H], as
        `forward` returns them there -> logits [..., V]."""
        if not self.is_last:
            raise RuntimeError(f"stage {self.index} has no head; only the last stage does")
        return self.lm_head(last_hidden)


def stage_tensor_names(cfg: TargetConfig, layer_range: range, first: bool, last: bool) -> set[str]:
    """The parameter names (target naming, no `model.` prefix) a stage holds."""
    with torch.device("meta"):
        model = TargetModel(cfg)
    names = set()
    for name, _ in model.named_parameters(remove_duplicate=False):
        if name.startswith("layers."):
            if int(name.split(".")[1]) in layer_range:
                names.add(name)
        elif name.startswith("embed_tokens.") and first:
            names.add(name)
        elif name.startswith(("norm.", "lm_head.")) and last:
            names.add(name)
    return names


def load_stage(
    path: str | Path,
    index: int,
    num_stages: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    *,
    config: TargetConfig | None = None,
) -> TargetStage:
    """Stage `index` of `num_stages` of the target in a transformers folder, reading only this
    stage's tensors (lm_head from the embeddings when they are tied). Frozen, eval mode.
    `config`: the folder's config.json, when the caller has read it already."""
    path = Path(path)
    cfg = config if config is not None else TargetConfig.from_pretrained(path)
    ranges = split_layers(cfg.num_layers, num_stages)
    first, last = index == 0, index == num_stages - 1
    with torch.device("meta"):
        model = TargetModel(cfg)
    stage = TargetStage.from_model(model, index, num_stages, ranges)
    wanted = stage_tensor_names(cfg, ranges[index], first, last)
    tied_head = last and cfg.tie_word_embeddings
    sources = {n: n for n in wanted}
    if tied_head:
        sources["lm_head.weight"] = "embed_tokens.weight"
    by_source: dict[str, list[str]] = {}
    for dst, src in sources.items():
        by_source.setdefault(src, []).append(dst)
    state: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt", device=str(device)) as sf:
            for key in sf.keys():
                for dst in by_source.get(key.removeprefix("model."), []):
                    state[dst] = sf.get_tensor(key).to(dtype)
    missing = sorted(wanted - set(state))
    if missing:
        raise ValueError(
            f"stage {index} of {num_stages} needs tensors that {path} does not hold: "
            f"{missing[:8]}{' ...' if len(missing) > 8 else ''}; is the folder complete?"
        )
    if first and last and cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    stage.load_state_dict(state, strict=False, assign=True)
    if stage.lm_head is not None and cfg.tie_word_embeddings and stage.embed_tokens is not None:
        stage.lm_head.weight = stage.embed_tokens.weight
    rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(device)
    rotary.__dict__["inv_freq64"] = rotary.__dict__["inv_freq64"].to(device)
    stage.__dict__["rotary"] = rotary
    _check_materialized(stage, path)
    stage.requires_grad_(False)
    return stage.eval()


def _check_materialized(stage: TargetStage, path: Path) -> None:
    meta = [n for n, p in stage.named_parameters() if p.is_meta]
    if meta:
        raise ValueError(f"stage {stage.index}: tensors {meta[:8]} were not found in {path}")
