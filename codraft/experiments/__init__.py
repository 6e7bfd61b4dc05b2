"""Experiments built on codraft's parts: the top layer, beside the CLI. They may import the
server, the learner and the client; nothing of the project imports them."""
