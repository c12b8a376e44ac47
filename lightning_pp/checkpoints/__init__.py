"""Checkpoints of a pruned pipeline: a full file one process can load, or a sharded directory that any
layout reads its own tensors from; written so that a process dying mid-save leaves a complete one.

Imports: ``layout``.
"""
