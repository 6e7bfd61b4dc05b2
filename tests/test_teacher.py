"""The teacher: head-only loading, exact match with the target's own logits from its post-norm
last hidden state, draft-vocab targets, and recompute of taps over packed batches.

The streamed last hidden state is the target's final hidden state after the final norm, so the
teacher is the lm_head alone: its logits of `TargetModel(...).last_hidden` must be the model's
logits, and of any [N, H] rows exactly `rows @ lm_head.weight.T` (no norm applied)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import codraft.learner.teacher as teacher_mod
from codraft.draft.vocab import ids_to_maps
from codraft.learner.data import Sample, pack
from codraft.learner.teacher import Teacher, load_head
from codraft.models.llama import load_target

TAPS = (1, 2, 3)


@pytest.fixture(scope="module")
def target(tiny_llama_dir: Path):
    return load_target(tiny_llama_dir)


def hidden(n: int, H: int = 64, seed: int = 0) -> torch.Tensor:
    """Rows shaped like final hidden states: post-norm, so of RMS about 1."""
    return torch.randn(n, H, generator=torch.Generator().manual_seed(seed))


def test_streamed_logits_equal_target_head_exactly(tiny_llama_dir: Path, target) -> None:
    t = Teacher.from_pretrained(tiny_llama_dir)
    assert t.mode == "streamed" and t.target is None
    assert not hasattr(t, "norm")
    # what a server streams: the model's post-norm last hidden state; its logits, bit for bit
    ids = torch.randint(0, 512, (1, 30), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        out = target(ids)
    assert torch.equal(t.logits(out.last_hidden[0]), out.logits[0])
    h = hidden(30)
    assert torch.equal(t.logits(h), target.head(h))
    assert torch.equal(t.logits(h), h @ target.lm_head.weight.T)  # the lm_head, no norm
    h3 = h.view(3, 10, 64)
    assert torch.equal(t.logits(h3), target.head(h3))
    # smaller chunks: BLAS may round a few rows differently by an ulp, nothing more
    t.chunk_tokens = 7
    torch.testing.assert_close(t.logits(h), target.head(h), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="hidden size"):
        t.logits(torch.zeros(3, 65))
    with pytest.raises(RuntimeError, match="recompute"):
        t.recompute(pack([Sample(torch.arange(4))]), TAPS)


def test_head_is_loaded_alone(tiny_llama_dir: Path, monkeypatch) -> None:
    read: list[str] = []
    real = teacher_mod.safe_open

    class Spy:
        def __init__(self, *a, **kw):
            self.f = real(*a, **kw)

        def __enter__(self):
            self.inner = self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_tensor(self, key):
            read.append(key)
            return self.inner.get_tensor(key)

    monkeypatch.setattr(teacher_mod, "safe_open", Spy)
    head = load_head(tiny_llama_dir)
    assert read == ["lm_head.weight"]  # no final norm: the streamed state is taken after it
    assert isinstance(head, torch.nn.Linear) and not head.weight.requires_grad


def test_tied_embeddings_use_embed_tokens(tiny_llama_dir: Path, tmp_path: Path, target) -> None:
    tied = tmp_path / "tied"
    shutil.copytree(tiny_llama_dir, tied)
    cfg = json.loads((tied / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    (tied / "config.json").write_text(json.dumps(cfg))
    state = load_file(tied / "model.safetensors")
    state.pop("lm_head.weight")
    save_file(state, tied / "model.safetensors", metadata={"format": "pt"})
    head = load_head(tied)
    assert torch.equal(head.weight, target.embed_tokens.weight)
    tied_target = load_target(tied)
    h = hidden(9)
    assert torch.equal(Teacher(head).logits(h), tied_target.head(h))
    ids = torch.arange(3, 12)[None]
    with torch.no_grad():
        out = tied_target(ids)
    assert torch.equal(Teacher(head).logits(out.last_hidden), out.logits)


def test_teacher_takes_the_lm_head_alone(target) -> None:
    with pytest.raises(TypeError):
        Teacher(target.norm, target.lm_head)
    with pytest.raises(TypeError, match="lm_head.*no final norm"):
        Teacher(target.norm)


def test_draft_logits_match_the_dense_head(tiny_llama_dir: Path, target) -> None:
    t = Teacher.from_pretrained(tiny_llama_dir, chunk_tokens=8)
    V = t.vocab_size
    ids = torch.randperm(V, generator=torch.Generator().manual_seed(1))[:100].sort().values
    _, t2d = ids_to_maps(ids, V)
    h = hidden(20, seed=2)
    z = t.draft_logits(h, t2d)
    assert z.shape == (20, 100) and z.dtype == t.dtype
    dense = target.head(h)[..., t2d]
    torch.testing.assert_close(z, dense, rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        out = target(torch.arange(5, 25)[None])
    torch.testing.assert_close(t.draft_logits(out.last_hidden[0], t2d), out.logits[0][..., t2d])
    _, t2d_full = ids_to_maps(torch.arange(V), V)
    torch.testing.assert_close(t.draft_logits(h, t2d_full), target.head(h))
    with pytest.raises(ValueError, match="bool mask"):
        t.draft_logits(h, ids)


def test_recompute_over_packed_batch(target) -> None:
    t = Teacher.from_model(target)
    assert t.mode == "recompute"
    g = torch.Generator().manual_seed(3)
    docs = [torch.randint(0, 512, (n,), generator=g) for n in (5, 12, 3)]
    batch = pack([Sample(d) for d in docs], pad_multiple=4)
    out = t.recompute(batch, TAPS, return_logits=True)
    filled = t.fill(batch, TAPS)
    valid = batch.valid
    assert not filled.taps[~valid].any() and not filled.last_hidden[~valid].any()
    for d, a, n in zip(docs, batch.cu_seqlens[:-1].tolist(), batch.doc_lens.tolist(), strict=True):
        ref = target(d[None], tap_layers=TAPS)
        torch.testing.assert_close(out.taps[a : a + n], ref.taps[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(filled.last_hidden[a : a + n], ref.last_hidden[0])
        torch.testing.assert_close(out.logits[a : a + n], ref.logits[0], rtol=1e-5, atol=1e-5)
        # last_hidden is post-norm: the final norm of tap L, the last layer's output
        L = target.config.num_layers
        prenorm = target(d[None], tap_layers=(L,), return_logits=False).taps[0]
        torch.testing.assert_close(out.last_hidden[a : a + n], target.norm(prenorm))
    assert torch.equal(out.logits, target.head(out.last_hidden))
    assert torch.equal(out.logits, target.lm_head(out.last_hidden))
