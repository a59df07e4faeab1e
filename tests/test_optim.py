"""Learning-rate schedule and optimizer groups (pure), and clipping in a world of one."""

import math

import pytest
import torch
import torch.distributed as dist

from meshtrain.config import LRScheduleConfig, OptimizerConfig
from meshtrain.optim import build_lr_scheduler, build_optimizer, clip_grad_norm_, lr_multiplier


def test_warmup_then_cosine_to_min():
    cfg = LRScheduleConfig(warmup_steps=4, decay="cosine", min_lr_ratio=0.1)
    got = [lr_multiplier(s, 14, cfg) for s in range(14)]
    assert got[:4] == [0.25, 0.5, 0.75, 1.0]
    assert got[4] == 1.0 and math.isclose(got[-1], 0.1)
    assert math.isclose(got[9], 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 5 / 9)))
    assert all(a >= b for a, b in zip(got[3:], got[4:]))


def test_linear_and_constant():
    lin = LRScheduleConfig(warmup_steps=0, decay="linear", min_lr_ratio=0.0)
    assert [lr_multiplier(s, 5, lin) for s in range(5)] == [1.0, 0.75, 0.5, 0.25, 0.0]
    const = LRScheduleConfig(warmup_steps=2, decay="constant")
    assert [lr_multiplier(s, 5, const) for s in range(5)] == [0.5, 1.0, 1.0, 1.0, 1.0]


def test_scheduler_drives_the_optimizer_lr():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2))
    opt = build_optimizer([model], OptimizerConfig(lr=1.0, weight_decay=0.1))
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert len(opt.param_groups[0]["params"]) == 1 and len(opt.param_groups[1]["params"]) == 3  # 1-D: no decay
    sched = build_lr_scheduler(opt, 4, LRScheduleConfig(warmup_steps=2, decay="linear", min_lr_ratio=0.0))
    lrs = []
    for _ in range(4):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == [0.5, 1.0, 1.0, 0.0]


@pytest.fixture
def world_of_one():
    from meshtrain.parallel.runtime import init_distributed, shutdown
    from meshtrain.parallel.layout import plan_layout
    from meshtrain.parallel.mesh import build_mesh
    from tests.conftest import tiny_config

    runtime = init_distributed(60)
    yield build_mesh(plan_layout(tiny_config(), 1), runtime.device.type)
    shutdown()


@pytest.mark.parametrize("max_norm", [0.0, 0.5, 1e9])
def test_clip_matches_torch(world_of_one, max_norm):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    for p in params:
        p.grad = torch.randn_like(p)
    ref = [p.grad.clone() for p in params]
    want = torch.nn.utils.get_total_norm(ref)
    got = clip_grad_norm_(params, max_norm, world_of_one)
    torch.testing.assert_close(got, want)
    if max_norm:
        scale = min(1.0, max_norm / (want.item() + 1e-6))  # torch's clip_grads_with_norm_ formula
        for p, r in zip(params, ref):
            torch.testing.assert_close(p.grad, r * scale)
    assert dist.get_world_size() == 1
