"""The job's shape, decided before any rank communicates.

The strategy's arguments normalised and checked once (``options``), where each rank sits in the
(replica, stage, tensor-parallel shard) grid and which process groups it joins (``mesh``), schedule
names and which stages each rank runs (``schedule``), and the tensors a rank holds as plain tensors or
DTensors (``dtensors``). Numbers and names only, so every other wing may use them.

Imports: ``lightning_pp.errors`` only.
"""
