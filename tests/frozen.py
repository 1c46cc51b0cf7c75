"""Imported last by the fork server (tests/conftest.py's ``PRELOAD``): ``gc.freeze()`` moves every
object the imports made (torch, transformers, deepspeed: millions) out of the garbage collector's
sight, so a forked rank's collections scan only what it made itself. Without it a full collection
in a rank walked them all (4.8% of the suite's CPU time went to the collector)."""

import gc

gc.freeze()
