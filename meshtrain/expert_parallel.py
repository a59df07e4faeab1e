"""Expert parallelism: each MoE layer's experts sharded over the mesh's "ep" dim, tokens sent to them
with all-to-all.

``ExpertParallel`` is a ParallelStyle for ``parallelize_module``: it makes the stacked expert
weights [E, ...] DTensors sharded on dim 0 (rank i of the ep group holds experts
i*E/ep .. (i+1)*E/ep - 1) and wraps the experts' forward in dispatch and combine. Dispatch: the
router's sorted token copies go to the ranks owning their experts (``all_to_all_single_autograd``
with uneven splits; the counts per expert are exchanged first), are regrouped by local expert, and
computed; combine sends the results back the same way, so the MoE block sees its own tokens in
its own order, and autograd runs the all-to-alls in reverse in backward.

ep folds over the dp x cp x tp ranks of a pipeline stage: an ep group is ep ranks that each bring
their own tokens. The experts are replicated over the edp = world / (pp * ep) groups, so after
backward ``reduce_expert_grads`` sums their gradients over edp and divides by dp x cp, giving the
gradient of the mean loss, as FSDP does for the dense weights (the tp ranks of a dp x cp rank hold
slices of one sequence, so their summands are added, not averaged).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle


class ExpertParallel(ParallelStyle):
    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        group = mesh.get_group()
        ep = mesh.size()

        def shard_experts(name, mod, device_mesh):
            for pname, param in list(mod.named_parameters(recurse=False)):
                sharded = nn.Parameter(distribute_tensor(param, device_mesh, [Shard(0)], src_data_rank=None))
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
            # received is grouped (source rank, local expert); the experts want (local expert, source)
            by_source = torch.arange(received.shape[0], device=x.device).split(counts_in.flatten().tolist())
            order = [by_source[src * local_experts + e] for e in range(local_experts) for src in range(ep)]
            order = torch.cat(order) if order else torch.zeros(0, dtype=torch.long, device=x.device)
            mod._ep_state = (order, send, recv)
            return received[order], counts_in.sum(0)

        def combine(mod, outputs, device_mesh):
            order, send, recv = mod._ep_state
            del mod._ep_state
            restored = torch.empty_like(outputs).index_copy(0, order, outputs)
            return all_to_all_single_autograd(restored, send, recv, group)

        return distribute_module(module, mesh, shard_experts, input_fn=dispatch, output_fn=combine)


def expert_parameters(module: nn.Module) -> list[nn.Parameter]:
    return [p for n, p in module.named_parameters() if ".experts." in f".{n}" or n.startswith("experts.")]


@torch.no_grad()
def reduce_expert_grads(params: list[torch.Tensor], edp_group: dist.ProcessGroup | None, loss_ranks: int) -> None:
    """Expert gradients -> the gradient of the mean loss over the stage's ranks (see the module doc)."""
    for p in params:
        if p.grad is None:
            continue
        local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        if edp_group is not None:
            dist.all_reduce(local, group=edp_group)
        local.div_(loss_ranks)
