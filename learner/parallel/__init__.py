"""Parallelism for the learner, applied from outside the model and the TTT code.

Context parallelism (docs/context_parallel.md):

- :mod:`codraft.learner.parallel.mesh`: ``ParallelDims`` / ``ParallelMesh`` (pp x dp x cp, groups).
- :mod:`codraft.learner.parallel.zigzag`: zigzag sharding of packed THD batches and its inverse.
- :mod:`codraft.learner.parallel.ring_comm`: batched isend/irecv ring shifts and neighbour swaps.
- :mod:`codraft.learner.attention.ring`: ring attention for one TTT pass (trunk ring + local
  branch).
- :mod:`codraft.learner.parallel.roll`: per-document left rolls across chunk boundaries.
- :mod:`codraft.learner.parallel.context`: ``ContextParallel``, one CP training step's pieces.
- :mod:`codraft.learner.parallel.launch`: torchrun start-up (``ParallelConfig``: cp, pp, device).

Pipeline parallelism for target recompute (docs/pipeline.md):

- :mod:`codraft.learner.parallel.stage`: the target split into stages (embeddings first, head last).
- :mod:`codraft.learner.parallel.microbatch`: whole-document microbatches every stage derives alike.
- :mod:`codraft.learner.parallel.pipeline`: the forward-only GPipe-style schedule.
- :mod:`codraft.learner.parallel.tapchannel`: TapChannel, taps from earlier stages to the draft's
  stage.
- :mod:`codraft.learner.parallel.pipeline_mesh`, :mod:`codraft.learner.parallel.pp_cp`: groups,
  and PP x CP.
- :mod:`codraft.learner.parallel.draft_stage`: the TTT step on the last stage
  (codraft.learner.pipeline_trainer runs it).
- :mod:`codraft.learner.parallel.host_staged`: transfers staged through host memory over gloo, when
  ranks share a GPU (single-GPU smoke runs; ``ParallelConfig.share_gpu``).

Nothing is imported at package level, so importing one module never drags in the others.
"""
