"""Give one object a mixin's methods while it keeps its class for everyone else.

The strategy adjusts objects the user or Lightning made (the precision plugin, its loss scaler, a
layer container) without replacing them: ``isinstance`` checks still hold, and the class keeps its
``__qualname__``, which Lightning uses as the plugin's checkpoint key.
"""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")

_DERIVED: dict[tuple[type, type], type] = {}


def derive(obj: T, mixin: type) -> T:
    """``obj`` with ``mixin`` in front of its class (once per class and mixin)."""
    cls = type(obj)
    if not issubclass(cls, mixin):
        derived = _DERIVED.get((cls, mixin))
        if derived is None:
            derived = type(f"Pipeline{cls.__name__}", (mixin, cls), {})
            derived.__qualname__ = cls.__qualname__
            _DERIVED[(cls, mixin)] = derived
        obj.__class__ = derived
    return obj
