"""Replica groups that survive a dead group (torchft): a quorum each step, gradients averaged stage with
stage across the live groups, a step that did not commit leaving no trace, a restarted group healed from a
live one (``groups``).

Imports: ``errors``, ``layout``, ``lifecycle``, ``checkpoints``, ``runtime``.
"""
