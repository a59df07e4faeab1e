"""Expert parallelism: each MoE layer's experts sharded over the mesh's "ep" dim, tokens sent to them
with all-to-all.

``ExpertParallel`` is a ParallelStyle for ``parallelize_module``: it makes the stacked expert
weights [E, ...] DTensors sharded on dim 0 (rank i of the ep group holds experts
i*E/ep .. (i+1)*E/ep - 1) and wraps the experts' forward in dispatch and combine. Dispatch: the
router's sorted token copies go to the ranks owning their experts (``all_to_all_single_autograd``
with uneven splits; the counts per expert are exchanged first), are regrouped by local expert, and
computed; combine sends the results back the same way, so the MoE block sees its own tokens in
its own order, and autograd runs the all-to-alls in reverse in backward.

With expert tensor parallelism the style is applied with the (ep, etp) mesh: gate/up are also
split on their FFN dim over etp, down on its input dim, and the etp ranks of an expert group all
compute every token copy the group received (gathered over etp before the experts, partial
outputs reduce-scattered after: Megatron's scheme, without its padding).

ep (x etp) folds over the dp x cp x tp ranks of a pipeline stage: an ep group is ep ranks that each
bring their own tokens. The edp = world / (pp * ep * etp) groups hold the same experts; FSDP shards
them over edp and reduces their gradients (``parallel.fsdp.apply_fsdp``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle


def _expert_major_order(counts_by_source: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Rows arrive grouped (source rank, local expert), ``counts_by_source[src, e]`` each; the
    experts want them grouped (local expert, source): the permutation that regroups them."""
    sources, local_experts = counts_by_source.shape
    by_source = torch.arange(int(counts_by_source.sum()), device=device).split(counts_by_source.flatten().tolist())
    order = [by_source[src * local_experts + e] for e in range(local_experts) for src in range(sources)]
    return torch.cat(order) if order else torch.zeros(0, dtype=torch.long, device=device)


def _gather_over_etp(x: torch.Tensor, counts: torch.Tensor, group: dist.ProcessGroup, etp: int):
    """All-gather this rank's token copies (sorted by local expert, ``counts`` each) over the etp
    group, as one autograd all-to-all of the repeated input (its backward sums the etp ranks'
    gradients: a reduce-scatter). Returns the copies regrouped by local expert, the counts per
    local expert, and what ``_scatter_over_etp`` needs to undo it."""
    all_counts = torch.empty(etp * counts.numel(), dtype=counts.dtype, device=counts.device)
    dist.all_gather_into_tensor(all_counts, counts, group=group)
    all_counts = all_counts.view(etp, -1)
    mine, theirs = x.shape[0], all_counts.sum(1).tolist()
    gathered = all_to_all_single_autograd(x.repeat(etp, 1), theirs, [mine] * etp, group)
    order = _expert_major_order(all_counts, x.device)
    return gathered[order], all_counts.sum(0), (order, mine, theirs)


def _scatter_over_etp(y: torch.Tensor, state, group: dist.ProcessGroup, etp: int) -> torch.Tensor:
    """Each etp rank computed a slice of the FFN for every gathered copy: send each source its rows
    back and sum the etp partial results (a reduce-scatter, as an autograd all-to-all)."""
    order, mine, theirs = state
    restored = torch.empty_like(y).index_copy(0, order, y)
    partial = all_to_all_single_autograd(restored, [mine] * etp, theirs, group)
    return partial.view(etp, mine, y.shape[-1]).sum(0)  # mine may be 0: no token routed to this group


class ExpertParallel(ParallelStyle):
    """Applied with the ep mesh, or the 2-D (ep, etp) mesh for expert tensor parallelism: each
    expert's gate/up then are column slices and down a row slice over etp, and the etp ranks of an
    expert group all compute every token copy sent to the group (gathered in, reduce-scattered out)."""

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        ep_mesh, etp_mesh = (mesh["ep"], mesh["etp"]) if mesh.ndim == 2 else (mesh, None)
        group, ep = ep_mesh.get_group(), ep_mesh.size()
        etp_group, etp = (etp_mesh.get_group(), etp_mesh.size()) if etp_mesh is not None else (None, 1)

        def shard_experts(name, mod, device_mesh):
            for pname, param in list(mod.named_parameters(recurse=False)):
                placements = [Shard(0)] if etp_mesh is None else [Shard(0), Shard(mod.ETP_DIMS[pname])]
                sharded = nn.Parameter(distribute_tensor(param, device_mesh, placements, src_data_rank=None))
                mod.register_parameter(pname, sharded)

        def dispatch(mod, inputs, device_mesh):
            x, counts = inputs
            local_experts = counts.numel() // ep
            # counts_in[src, e]: tokens rank src sends to my local expert e
            counts_in = torch.empty_like(counts)
            dist.all_to_all_single(counts_in, counts, group=group)
            send = counts.view(ep, local_experts).sum(1).tolist()
            counts_in = counts_in.view(ep, local_experts)
            recv = counts_in.sum(1).tolist()
            received = all_to_all_single_autograd(x, recv, send, group)
            order = _expert_major_order(counts_in, x.device)
            tokens, local_counts, etp_state = received[order], counts_in.sum(0), None
            if etp > 1:
                tokens, local_counts, etp_state = _gather_over_etp(tokens, local_counts, etp_group, etp)
            mod._ep_state = (order, send, recv, etp_state)
            return tokens, local_counts

        def combine(mod, outputs, device_mesh):
            order, send, recv, etp_state = mod._ep_state
            del mod._ep_state
            if etp > 1:
                outputs = _scatter_over_etp(outputs, etp_state, etp_group, etp)
            restored = torch.empty_like(outputs).index_copy(0, order, outputs)
            return all_to_all_single_autograd(restored, send, recv, group)

        return distribute_module(module, mesh, shard_experts, input_fn=dispatch, output_fn=combine)


def expert_parameters(module: nn.Module) -> list[nn.Parameter]:
    return [p for n, p in module.named_parameters() if ".experts." in f".{n}" or n.startswith("experts.")]
