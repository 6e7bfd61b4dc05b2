"""A small GRPO loop for the RL co-training experiment (scripts/rl_cotrain.py, docs/rl.md).

| module | what |
|---|---|
| `reward` | answer-format + correctness reward (reasoning-gym's scorer) |
| `grpo` | group-normalised advantages and the token-level clipped policy-gradient loss |
| `policy` | the policy model on CPU: token log-probs, AdamW steps, served-layout safetensors |
| `servers` | one arm's server: `codraft serve` (+ learner) or plain vLLM; policy pushes, counters |
| `rollout` | groups of sampled completions and greedy probes through the `openai` client |
| `lossless` | greedy probes against the policy's argmax, served vs recomputed log-probs |
| `plot` | the per-step figure of the three arms |
"""
