"""Parallelism for the learner, applied from outside the model and the TTT code.

Context parallelism (docs/context_parallel.md):

- :mod:`learner.parallel.mesh`: ``ParallelDims`` / ``ParallelMesh`` (pp x dp x cp, groups).
- :mod:`learner.parallel.zigzag`: zigzag sharding of packed THD batches and its inverse.
- :mod:`learner.parallel.ring_comm`: batched isend/irecv ring shifts and neighbour swaps.
- :mod:`learner.attention.ring`: ring attention for one TTT pass (trunk ring + local branch).
- :mod:`learner.parallel.roll`: per-document left rolls across chunk boundaries.
- :mod:`learner.parallel.context`: ``ContextParallel``, one CP training step's pieces.
- :mod:`learner.parallel.launch`: torchrun start-up (``--cp``).

Pipeline parallelism and TapChannel live in their own modules here. Nothing is imported at
package level, so importing one module never drags in the others.
"""
