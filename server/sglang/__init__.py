"""codraft's SGLang engine: what is specific to SGLang (docs/sglang.md). What both engines
share - the tap message, its assembly and publication, draft checks - lives in codraft.server
and codraft.tap."""
