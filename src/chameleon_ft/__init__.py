"""Chameleon: adaptive fault tolerance for data x pipeline parallel LLM training.

The planning core (``spec``, ``profile``, ``plan``, ``perf``, ``recovery``, ``policy``,
``sim``) is pure Python and never imports torch; only ``runtime`` does.
"""

__version__ = "0.1.0"
