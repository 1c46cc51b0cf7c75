"""Every causal-LM family transformers registers, shrunk (``shrink_config``) from its default config
and run through ``verify_sequence_parallel`` on 2 gloo ranks: exact, refused (the coverage check or
a named unsupported feature), MISMATCH (SP computes another model: a defect) or error (the default
config cannot be shrunk or built). One line per family, written as it finishes.

    python benchmarks/family_sweep.py [--out results/family_sweep.txt] [--families llama,qwen3_next]
"""

from __future__ import annotations

import argparse
import time
import warnings

REFUSALS = ("cannot run under sequence parallelism", "not supported by ulysses_sp", "ran without calling", "needs the global position_ids",
            "did not receive the packed documents' boundaries", "checks text causal LMs and the image-text families")


def _rank(rank: int, world: int, names: list, out_path: str) -> None:
    warnings.filterwarnings("ignore")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    import ulysses_sp as usp

    topo = usp.init_sequence_parallel(world, timeout=120)
    for name in names:
        started = time.time()
        try:
            config = CONFIG_MAPPING[name]()
            config = config.get_text_config() if hasattr(config, "get_text_config") else config
            report = usp.verify_sequence_parallel(config, topo, raise_on_mismatch=False)
            run, where, err = report.worst
            row = ("exact" if report.passed else "MISMATCH", f"{err:.1e} {where} {run}")
        except ValueError as e:
            row = ("refused" if any(r in str(e) for r in REFUSALS) else "error", str(e).replace("\n", " ")[:200])
        except Exception as e:  # noqa: BLE001 - a family that cannot be shrunk or built is reported, not fatal
            row = ("error", f"{type(e).__name__}: {str(e)[:160]}")
        if rank == 0:
            with open(out_path, "a") as f:
                f.write(f"{name} | {row[0]} | {row[1]} | {time.time() - started:.1f} s\n")


def main() -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from ulysses_sp.launch import run_ranks

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="family_sweep.txt")
    p.add_argument("--families", default="", help="comma-separated model types (default: every causal-LM family)")
    a = p.parse_args()
    open(a.out, "w").close()
    names = a.families.split(",") if a.families else sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    run_ranks(_rank, 2, names, a.out, timeout=3600)


if __name__ == "__main__":
    main()
