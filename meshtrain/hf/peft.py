"""LoRA adapters as a PEFT adapter directory: ``adapter_model.safetensors`` under PEFT's names
(``base_model.model.<HF module path>.lora_A.weight``) and ``adapter_config.json``, which
``peft.PeftModel.from_pretrained`` loads onto the base Hugging Face model.

Stacked expert adapters [E, ...] are written per expert under the checkpoint's per-expert module
names (``...mlp.experts.3.gate_proj.lora_A.weight``; Mixtral's ``w1``/``w3``/``w2``), the names
LoRA on those experts has in PEFT; peft (0.21) converts them on loading for transformers 5's fused
experts (A concatenated, B block-diagonal over gate and up, rank and alpha doubled).

Adapters of experts the checkpoint stacks (GPT-OSS) are written as peft's adapters of those
parameters (``target_parameters``, ``stacked_expert_tensors``).
Adapters of linears the checkpoint fuses (Phi-3's q/k/v_proj in ``qkv_proj``) are written the same
way, as one adapter of the fused module: A the parts' A stacked, B theirs block-diagonal (zero rows
for a part without an adapter), rank and alpha times the parts adapted (``rank_pattern`` and
``alpha_pattern``), so that alpha / rank, and each part's update, are unchanged."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from meshtrain.config import ModelConfig, PeftConfig
from meshtrain.hf.adapter import to_hf, to_hf_name
from meshtrain.hf.io import INCOMPLETE, agreed_export_target
from meshtrain.models.lora import MAGNITUDE, adapter_tensors


def peft_tensors(name: str, adapter: torch.Tensor, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """``layers.0.self_attn.q_proj.lora_A`` -> ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``;
    ``layers.0.mlp.experts.gate_proj_lora_A`` [E, r, in] -> ``...mlp.experts.{e}.gate_proj.lora_A.weight`` [r, in]
    for each expert e (the base weight's HF names, through the same mapping)."""
    owner, _, leaf = name.rpartition(".")
    if leaf == MAGNITUDE:  # DoRA's, PEFT's only tensor without ".weight"
        weight, suffix = f"{owner}.weight", "lora_magnitude_vector"
    else:
        kind = leaf[-len("lora_A"):]  # lora_A or lora_B
        weight = f"{owner}.weight" if leaf == kind else f"{owner}.{leaf.removesuffix('_' + kind)}"
        suffix = f"{kind}.weight"
    hf = to_hf({weight: adapter}, cfg) or {to_hf_name(weight): adapter}  # a tied output head has no HF weight
    return {f"base_model.model.{key.removesuffix('.weight')}.{suffix}": value for key, value in hf.items()}


_LAYER_ADAPTER = re.compile(r"(layers\.\d+)\.(.+)\.([^.]+)")
_STACKED_ADAPTER = re.compile(r"(layers\.\d+\.mlp\.experts)\.(\w+)_(lora_[AB])")


def stacked_expert_tensors(adapters: dict[str, torch.Tensor], cfg: ModelConfig) -> tuple[dict, dict, list[str]]:
    """Adapters of experts the checkpoint stacks (GPT-OSS's ``gate_up_proj`` [E, in, out]) as peft
    holds adapters of such parameters (``target_parameters``): A [E, r, in] as [E * r, in], B
    [E, out, r] as [out, r * E] (rank-major), under the experts module's name, each projection
    wrapping the ones before it (``...experts.base_layer.lora_A.weight`` for gate_up_proj when
    down_proj is adapted too). Returns those tensors, the other adapters, and the parameters."""
    experts = cfg.definition.experts
    if experts is None or not experts.stacked:
        return {}, adapters, []
    rest, found = {}, {}
    for name, tensor in adapters.items():
        m = _STACKED_ADAPTER.fullmatch(name)
        if m is None:
            rest[name] = tensor
        else:
            found.setdefault(m[1], {}).setdefault(m[2], {})[m[3]] = tensor
    with torch.device("meta"):  # the order of the projections is the family's experts class's
        order = type(cfg.definition.experts_module(cfg)).PROJECTIONS
    tensors, parameters = {}, set()
    for owner, projections in found.items():
        adapted = [p for p in order if p in projections]
        for depth, projection in enumerate(adapted):
            prefix = f"base_model.model.model.{owner}" + ".base_layer" * (len(adapted) - 1 - depth)
            a, b = projections[projection]["lora_A"], projections[projection]["lora_B"]
            tensors[f"{prefix}.lora_A.weight"] = a.reshape(-1, a.shape[-1])
            tensors[f"{prefix}.lora_B.weight"] = b.permute(1, 2, 0).reshape(b.shape[1], -1)
            parameters.add(projection)
    return tensors, rest, sorted(parameters)


def fuse_adapters(adapters: dict[str, torch.Tensor], cfg: ModelConfig) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """The adapters with those of a fused module's parts as one adapter of it, and each such HF
    module -> how many parts' adapters it holds."""
    family = cfg.definition
    owner = family.fused_into
    out, groups = {}, {}
    for name, tensor in adapters.items():
        m = _LAYER_ADAPTER.fullmatch(name)
        if m is not None and m[2] in owner:  # layers.N, the part (self_attn.q_proj), lora_A/lora_B/magnitude
            groups.setdefault((m[1], owner[m[2]]), {}).setdefault(m[2], {})[m[3]] = tensor
        else:
            out[name] = tensor
    counts = {}
    for (layer, fused), adapted in groups.items():
        parts = family.fused[fused]
        rank = next(iter(adapted.values()))["lora_A"].shape[0]
        a = [adapted[p]["lora_A"] for p in parts if p in adapted]
        part_rows = [family.part_rows(cfg, p) for p in parts]
        b = torch.zeros(sum(part_rows), rank * len(a))
        row, column = 0, 0
        for part, rows in zip(parts, part_rows):
            if part in adapted:
                b[row:row + rows, column:column + rank] = adapted[part]["lora_B"]
                column += rank
            row += rows
        out[f"{layer}.{fused}.lora_A"], out[f"{layer}.{fused}.lora_B"] = torch.cat(a), b
        if any(MAGNITUDE in tensors for tensors in adapted.values()):  # check_lora: every part adapted
            out[f"{layer}.{fused}.{MAGNITUDE}"] = torch.cat([adapted[p][MAGNITUDE] for p in parts])
        counts[f"model.{layer}.{fused}"] = len(a)
    return out, counts


def peft_targets(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> tuple[list[str], list[str]]:
    """adapter_config.json's target_modules and target_parameters for these adapter tensors.

    peft (0.21) on transformers 5 rewrites the target_modules of an MoE model for its fused experts:
    every ``gate_proj``/``up_proj``/``down_proj`` becomes the experts' ``gate_up_proj``/``down_proj``,
    so the adapters of a dense MLP beside MoE layers (Qwen3-MoE's mlp_only_layers) would be dropped
    on loading. Those are named as target_parameters (``gate_proj.weight``: only a dense linear's
    weight ends so) instead, which peft loads under the same tensor names."""
    modules, parameters = set(), set()
    experts = cfg.definition.experts
    expert_leaves = set(experts.names.values()) if experts else set()
    for key in tensors:
        if not key.endswith(".lora_A.weight"):
            continue
        path = key.removesuffix(".lora_A.weight")
        leaf = path.rsplit(".", 1)[-1]
        if leaf in expert_leaves and ".experts." not in path:
            parameters.add(f"{leaf}.weight")
        else:
            modules.add(leaf)
    return sorted(modules), sorted(parameters)


def save_peft_adapter(parts: list[torch.nn.Module], directory: str, cfg: PeftConfig, model_cfg: ModelConfig,
                      base: str | None, dtype: torch.dtype) -> pathlib.Path:
    """Every rank calls this; rank 0 writes (under ``DIR.incomplete``, renamed when done)."""
    out = agreed_export_target(directory)  # before any rank writes (see there)
    mine: dict[str, torch.Tensor] = {}
    for part in parts:
        mine.update(adapter_tensors(part))
    every = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:  # pipeline stages hold different layers
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
    if not dist.is_initialized() or dist.get_rank() == 0:
        adapters, stacked = fuse_adapters({n: t for part in every for n, t in part.items()}, model_cfg)
        expert_tensors, adapters, expert_parameters = stacked_expert_tensors(adapters, model_cfg)
        tensors = {key: t.to(dtype, copy=True) for n, adapter in adapters.items()
                   for key, t in peft_tensors(n, adapter, model_cfg).items()}
        modules, parameters = peft_targets(tensors, model_cfg)
        tensors |= {key: t.to(dtype, copy=True) for key, t in expert_tensors.items()}
        parameters = sorted(set(parameters) | set(expert_parameters))
        patterns = {re.escape(module): count for module, count in stacked.items() if count > 1}
        tmp = out.with_name(out.name + INCOMPLETE)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        (tmp / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.rank, "lora_alpha": cfg.alpha,
            "lora_dropout": cfg.dropout, "target_modules": modules, **({"target_parameters": parameters} if parameters else {}),
            **({"rank_pattern": {k: cfg.rank * n for k, n in patterns.items()},
                "alpha_pattern": {k: cfg.alpha * n for k, n in patterns.items()}} if patterns else {}),
            "bias": "none", "fan_in_fan_out": False,
            "use_dora": cfg.method == "dora",
            "base_model_name_or_path": os.path.abspath(base) if base else None, "inference_mode": True,
        }, indent=2) + "\n")
        if out.exists():
            out.rmdir()  # empty, checked above
        tmp.rename(out)
    if dist.is_initialized():
        dist.barrier()
    return out
