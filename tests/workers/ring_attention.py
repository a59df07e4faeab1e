"""Ring attention on load-balanced sequence shards against full causal attention, forward and
backward, over every rank of the batch (args: the rotate method). Raises if they differ."""

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental._attention import context_parallel_unshard, set_rotate_method

from meshtrain.parallel._torch_cp import cpu_context_parallel


def run(args, out, runtime) -> None:
    (rotate,) = args
    set_rotate_method(rotate)
    world = runtime.world_size
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    torch.manual_seed(0)  # the same full tensors on every rank
    batch, heads, kv_heads, seq, dim = 2, 4, 2, 16 * world, 8  # grouped-query attention
    q, g = (torch.randn(batch, heads, seq, dim) for _ in range(2))
    k, v = (torch.randn(batch, kv_heads, seq, dim) for _ in range(2))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    want_out = F.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=True)
    want_out.backward(g)
    want = [want_out.detach()] + [t.grad for t in full]

    local = [t.clone() for t in (q, k, v, g)]
    with cpu_context_parallel(mesh, local, [2, 2, 2, 2]):
        assert local[0].shape[2] == seq // world
        lq, lk, lv = (t.clone().requires_grad_() for t in local[:3])
        result = F.scaled_dot_product_attention(lq, lk, lv, is_causal=True, enable_gqa=True)
        result.backward(local[3])
        got = context_parallel_unshard(mesh, [result.detach(), lq.grad, lk.grad, lv.grad], [2, 2, 2, 2])
    for name, a, b in zip(("out", "grad_q", "grad_k", "grad_v"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6, msg=f"{name} on cp{world} ({rotate})")
    assert torch.equal(local[0], q), "the buffers are restored on exit"
