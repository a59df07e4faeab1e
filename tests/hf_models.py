"""Tiny random Hugging Face checkpoints, written with transformers from configs (nothing downloads)."""

from __future__ import annotations

import glob
import pathlib

import torch

FAMILIES = {
    "llama": dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256,
                  rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 64}),
    "qwen3": dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, max_position_embeddings=256),
}


def hf_model(family: str, dtype=torch.float32, seed: int = 0, **overrides):
    import transformers

    config_cls = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config}[family]
    model_cls = {"llama": transformers.LlamaForCausalLM, "qwen3": transformers.Qwen3ForCausalLM}[family]
    config = config_cls(**(FAMILIES[family] | overrides), bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = model_cls(config).to(dtype).eval()
    with torch.no_grad():  # norm weights start at one: make them carry information too
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def write_hf_dir(path: pathlib.Path, family: str = "llama", dtype=torch.float32, shard: str | None = "150KB",
                 **overrides) -> pathlib.Path:
    model = hf_model(family, dtype, **overrides)
    model.save_pretrained(path, max_shard_size=shard) if shard else model.save_pretrained(path)
    return path


def read_tensors(path: pathlib.Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(glob.glob(str(path / "*.safetensors"))):
        out.update(load_file(f))
    return out


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Bit-exact: same keys, dtypes, shapes and bytes."""
    assert sorted(a) == sorted(b), set(a) ^ set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].view(-1).view(torch.uint8), b[k].view(-1).view(torch.uint8)), k
