"""The split: the user's module into pipeline stages, the batch into micro-batches.

Which layers each stage owns (``partition``, costs measured by ``profiling``), which parts come before,
between and after the layers (``stage``, learned by ``planning`` from one forward on meta), parameters
several stages use (``tied``), and what torch's ``PipelineStage`` runs for a stage: the user's forward
on a pruned view (``pruned``) or torch's traced pieces (``traced``).

Imports: ``layout``, ``memory``, ``checkpoints`` (peft's names and wrappers, ``checkpoints.adapters``).
"""
