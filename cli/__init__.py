"""Command-line tools (installed as ``ulysses_sp.cli``): ``sp-bench``."""
