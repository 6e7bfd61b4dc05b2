"""codraft: online co-training of EAGLE-3 speculative-decoding drafts against a changing target.

One import root. This folder holds the foundation (models, draft, tap, control_token, ...), the
CLI (`codraft.cli`) and the experiments (`codraft.experiments`); `codraft.server`,
`codraft.learner` and `codraft.client` install from the repository's server/, learner/ and
client/ folders (pyproject.toml's package-dir). docs/architecture.md gives the layers.
"""
