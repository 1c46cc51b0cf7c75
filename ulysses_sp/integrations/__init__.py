"""Integrations with training frameworks. Each imports its framework lazily:
``ulysses_sp.integrations.transformers`` needs the ``hf`` extra."""
