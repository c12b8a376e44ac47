"""One pipelined step and what Lightning sees of it.

torch's schedule runs the stages (``step``; PipeDream-2BW in ``twobw``); the loss and logs of the
user's step on the last stage are relayed to every rank (``relay``, ``metrics``); gradients, loss weights
and the precision plugin keep Lightning's meaning under the pipeline (``grads``, ``weighting``,
``precision``); ``telemetry`` times what each stage did.

Imports: ``layout``, ``lifecycle``, ``memory``, ``split``.
"""
