"""Memory of models larger than one device: built on meta, each rank materialising only its own stage;
activations recomputed in backward; freed memory returned to the OS.

Imports: ``layout``.
"""
