"""Float8 training of the decoder's linear layers with torchao (``train.float8``).

Each projection inside the decoder layers becomes torchao's ``Float8Linear`` (dynamic per-tensor
scaling: inputs and weights in e4m3, gradients in e5m2; fp32 master weights stay as they are),
before any parallelism is applied, on the meta device like the rest of the model. The embedding
and lm_head keep the compute dtype, as torchtitan does: the output projection is the layer most
sensitive to precision. Float8 matmuls need CUDA float8 tensor cores (``torch._scaled_mm``), so
``check_float8`` refuses any other device before a job starts, unless ``train.float8_emulate`` asks
for torchao's emulation (the same float8 rounding and scaling, a high-precision matmul).

Where FSDP shards the weights, they are all-gathered in float8 (torchao's FSDP2 extension:
each shard cast with the scale of the whole weight, its amax all-reduced first), and
``precompute_fsdp_scales`` after each optimizer step computes every weight's amax in one all-reduce
instead of one per weight, as torchtitan does.
"""

from __future__ import annotations

import importlib.util

from torch import nn

from meshtrain.errors import ConfigError


def check_float8(device_type: str, *, sequence_parallel: bool, emulate: bool = False) -> None:
    """The rules of train.float8, checked before any process group exists."""
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError("train.float8=true needs the torchao package. Fix: pip install 'meshtrain[float8]', "
                          "or set train.float8=false")
    if device_type != "cuda" and not emulate:
        raise ConfigError(f"train.float8=true needs CUDA float8 tensor cores; this job runs on {device_type}. "
                          "Fix: set train.float8=false, run on H100/H200-class GPUs, or set "
                          "train.float8_emulate=true for float8's numerics without its speed")
    if device_type != "cuda" and sequence_parallel:
        # Under SP the projections' input is cast to float8 before its all-gather; NCCL moves float8
        # tensors, gloo raises "Invalid scalar type" (torch 2.13).
        raise ConfigError("train.float8=true with parallel.sp=true needs CUDA: sequence parallelism all-gathers "
                          f"float8 activations, which {device_type}'s collectives (gloo) cannot carry. "
                          "Fix: set parallel.sp=false (tp without SP works), or run on GPUs")


def _eligible(module: nn.Module, name: str) -> bool:
    # float8 matmuls need both dims divisible by 16; the head and the MoE routers (whose logits
    # pick the experts) stay in the compute dtype
    return (isinstance(module, nn.Linear) and name.startswith("layers.") and not name.endswith(".mlp.gate")
            and module.in_features % 16 == 0 and module.out_features % 16 == 0)


def convert_to_float8(model: nn.Module, *, fsdp_all_gather: bool = False, emulate: bool = False) -> list[str]:
    """Swap the eligible linears for Float8Linear in place; returns their names. ``fsdp_all_gather``:
    their weights become torchao's float8-all-gathered FSDP2 tensors (for sharded data parallelism)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    converted = [name for name, module in model.named_modules() if _eligible(module, name)]
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp_all_gather, emulate=emulate)
    convert_to_float8_training(model, config=config, module_filter_fn=_eligible)
    return converted


def precompute_fsdp_scales(model: nn.Module) -> None:
    """Every float8-all-gathered weight's scale for the next forward, from one all-reduce of amaxes
    (after the optimizer step has changed the weights)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)
