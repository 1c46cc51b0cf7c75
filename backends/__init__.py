"""Sequence-parallel attention strategies, one module each (installed as ``ulysses_sp.backends``).

A backend never imports another backend; shared pieces live in ``ulysses_sp.comm``,
``ulysses_sp.kernels`` and ``ulysses_sp.layout``.
"""
