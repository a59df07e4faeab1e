"""Parallelism on one 5-D DeviceMesh: the layout rules (layout), the mesh (mesh), the process group
(runtime), and one module per kind: tensor (TP/SP), fsdp (FSDP2/HSDP), context (CP), pipeline (PP),
expert (EP/ETP); parallelize applies them in order. Private torch APIs live in the _torch_* files."""
