"""``meshtrain plan``: recommend a starting layout and estimate each GPU's memory, formulas shown.

The model is a ``ModelShape``: read from a meshtrain YAML, a Hugging Face config.json, or derived
from a parameter count (the nearest Llama 3 shape, layers scaled to the count). The shape gives a
tensor inventory that mirrors what the trainer allocates (``parameter_tensors``): each tensor's
shape and how tensor, expert and fully-sharded data parallelism cut it. Per-rank bytes are then
exact counts of local shard elements, the same ``torch.chunk`` split FSDP2 makes, so
tests/test_planner.py checks them against the trainer's real allocation.

Activations are counted per decoder layer as the tensors autograd saves for backward in this
model (SwiGLU MLP, grouped-query attention with a fused SDPA kernel that keeps no score matrix),
for one micro-batch; under 1F1B the first pipeline stage keeps min(pp, micro-batches) of them in
flight. The recommendation starts from the table of the reference (section 3), picks inside the
table's ranges by topology, and takes the first candidate that ``parallel.layout.plan_layout`` accepts and
that fits in memory. Sizes the user fixes are validated by the same rules the trainer enforces.

Modules: ``options`` (PlanConfig), ``shapes`` (the model and its tensor inventory), ``memory``
(per-rank bytes and activations), ``recommend`` (the reference table and candidate search),
``report`` (the printed plan).
"""
