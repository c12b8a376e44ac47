"""The planner, ``python -m lightning_pp.plan [train overrides]`` or ``plan_module`` from Python: every
valid configuration simulated (``simulate``, ``planner``) with costs measured on the model and the
machine (``calibrate``), ranked, and the best verified through the app (``app``).

Imports: ``train`` and the strategy (as a user would), ``layout``, ``memory``, ``split``, ``runtime``, ``choose``.
"""

from typing import Any

__all__ = ["plan_module"]


def __getattr__(name: str) -> Any:
    """``from lightning_pp.plan import plan_module`` imports the app on use: ``python -m
    lightning_pp.plan.calibrate`` (a rank of the calibration job) must not have imported itself already."""
    if name in __all__:
        from lightning_pp.plan import app

        return getattr(app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
