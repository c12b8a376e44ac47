"""The configuration the first batch chooses (``schedule="auto"`` and the other ``"auto"`` arguments).

The model's costs measured on the real batch (``costs``), the machine's (``machine``), every configuration
replayed through torch's own action lists (``simulate``) and ranked (``planner``), and the one every rank
runs (``auto``). The planner's app (``lightning_pp.plan``) starts from the same functions.

Imports: ``layout``, ``memory`` (what planning's profile left, returned), ``checkpoints``, ``split``, ``runtime``
(the simulator's timeline is the telemetry's events; the forecast checked against the first steps).
"""
