"""The planner, ``python -m lightning_pp.plan [train overrides]`` or ``plan_module`` from Python: every
valid configuration simulated (``simulate``, ``planner``) with costs measured on the model and the
machine (``calibrate``), ranked, and the best verified through the app (``app``).

Imports: ``train`` and the strategy (as a user would), ``layout``, ``split``, ``runtime``.
"""

from lightning_pp.plan.app import plan_module, profile_module

__all__ = ["plan_module", "profile_module"]
