"""The model families, one module each: ``model.family`` is the module's name, and the module's
``FAMILY`` (a ``models.family.Family``) is everything meshtrain knows about it. Adding a family is
adding a module here (see docs/adding-a-family.md); nothing else lists them."""

from __future__ import annotations

import functools
import importlib
import pkgutil
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # importing a family imports torch; listing the names does not
    from meshtrain.models.family import Family


@functools.cache
def names() -> tuple[str, ...]:
    """Every family's name, without importing the modules (config.py builds model.family's choices
    from these before torch is needed)."""
    return tuple(sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")))


@functools.cache
def get(name: str) -> Family:
    if name not in names():
        raise KeyError(f"model.family={name!r} is not a family; families: {', '.join(names())}")
    family = importlib.import_module(f"{__name__}.{name}").FAMILY
    if family.name != name:
        raise RuntimeError(f"models/families/{name}.py defines the family {family.name!r}: name it {name!r}")
    return family


def every() -> list[Family]:
    return [get(name) for name in names()]


def by_architecture(architecture: str | None, model_type: str | None) -> Family | None:
    """The family of a config.json's ``architectures[0]``, or of its ``model_type`` when it names no
    architecture (a config built in memory; save_pretrained writes architectures)."""
    for family in every():
        if (architecture and family.architecture == architecture) or (not architecture and family.model_type == model_type):
            return family
    return None
