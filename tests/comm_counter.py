"""Count the collectives one region issues, by op name.

torch's CommDebugMode counts the same ops but its per-module tracker raises IndexError on FSDP2
modules in torch 2.13.0, so this is the counting part alone. It uses the private
``torch.utils._python_dispatch.TorchDispatchMode`` (checked against torch 2.13.0).
"""

from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode

NAMESPACES = ("c10d", "_c10d_functional")
NOT_COLLECTIVES = ("wait_tensor", "barrier", "monitored_barrier", "_wrap_tensor_autograd")


class CollectiveCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        ns, name = func.namespace, func._schema.name.split("::")[-1]
        if ns in NAMESPACES and name not in NOT_COLLECTIVES:
            self.counts[name.rstrip("_").removesuffix("_into_tensor").removesuffix("_tensor")] += 1
        return func(*args, **(kwargs or {}))
