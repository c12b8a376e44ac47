"""Generation through the pipeline: the prompts prefilled through the stages, then one token at a time, each
stage keeping the key/value cache of its own layers, the last stage choosing each token (``sampling``), every
stage running its part of the model in Hugging Face's calling convention (``stages``), the micro-batches
travelling the ring of stages one behind the other (``ring``).

Imports: ``errors``, ``layout``, ``split``, ``holding``.
"""
