"""The decoder-only transformer (Llama, Qwen3, Qwen3-MoE, Mixtral) in plain PyTorch, its MoE block and
its layout-independent initialisation."""
