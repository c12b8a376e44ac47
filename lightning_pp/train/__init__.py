"""The Hydra app, ``python -m lightning_pp.train [overrides]`` (``-m`` for sweeps): one job (``app``) and
the summary of a sweep (``sweep``). Configs live in ``lightning_pp/conf``.

Imports: the strategy and ``callbacks`` (as any user script would), ``layout``, ``lifecycle``, ``split``.
"""
