"""Evaluation with lm-evaluation-harness (the ``eval`` extra: ``pip install 'edl-jax[eval]'``)."""
