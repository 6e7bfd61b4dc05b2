"""The codraft target model family (Llama, Qwen2, Qwen3) and shared layers."""
