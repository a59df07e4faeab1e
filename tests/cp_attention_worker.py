"""Run on every rank by torchrun: ring attention on load-balanced sequence shards against full
causal attention, forward and backward (exit 1 if they differ).

    torchrun ... tests/cp_attention_worker.py ROTATE_METHOD
"""

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental._attention import context_parallel_unshard, set_rotate_method

from meshtrain.parallel._torch_cp import cpu_context_parallel
from meshtrain.parallel.runtime import exit_process, shutdown


def main() -> None:
    dist.init_process_group("gloo")
    try:
        set_rotate_method(sys.argv[1])
        world = dist.get_world_size()
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
            out = F.scaled_dot_product_attention(lq, lk, lv, is_causal=True, enable_gqa=True)
            out.backward(local[3])
            got = context_parallel_unshard(mesh, [out.detach(), lq.grad, lk.grad, lv.grad], [2, 2, 2, 2])
        for name, a, b in zip(("out", "grad_q", "grad_k", "grad_v"), got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6, msg=f"{name} on cp{world} ({sys.argv[1]})")
        assert torch.equal(local[0], q), "the buffers are restored on exit"
    except BaseException:
        shutdown()
        raise
    shutdown(synchronize=True)
    exit_process(0)  # see exit_process: a clean exit without gloo's teardown race


if __name__ == "__main__":
    main()
