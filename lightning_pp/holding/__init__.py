"""What this rank holds of the user's module: its stages pruned from the whole, materialised on the
device, FSDP-sharded over the replicas (``sharding``), and restored from a checkpoint (``stages``).

Imports: ``layout``, ``memory``, ``checkpoints``, ``split``.
"""
