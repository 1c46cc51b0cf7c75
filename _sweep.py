import os, sys, time, traceback, warnings
warnings.filterwarnings("ignore")
def run(rank, world, names):
    import transformers, torch
    import ulysses_sp as usp
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    topo = usp.init_sequence_parallel(world, timeout=120)
    out = {}
    for name in names:
        t = time.time()
        try:
            cfg = CONFIG_MAPPING[name]()
            if hasattr(cfg, "get_text_config"):
                cfg = cfg.get_text_config()
            r = usp.verify_sequence_parallel(cfg, topo, raise_on_mismatch=False)
            out[name] = ("exact" if r.passed else "MISMATCH", f"{r.worst[2]:.1e} {r.worst[1]} {r.worst[0]}")
        except ValueError as e:
            msg = str(e)
            out[name] = ("refused" if "cannot run under sequence parallelism" in msg or "not supported by ulysses_sp" in msg or "ran without calling" in msg or "needs the global position_ids" in msg else "valueerror", msg.replace("\n", " ")[:220])
        except Exception as e:
            out[name] = ("error", f"{type(e).__name__}: {str(e)[:160]}")
        out[name] += (round(time.time() - t, 1),)
        if rank == 0:
            with open("/tmp/sweep.live", "a") as f:
                f.write(name + " | " + " | ".join(map(str, out[name])) + "\n")
    return out
if __name__ == "__main__":
    from ulysses_sp.launch import run_ranks
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    names = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    res = run_ranks(run, 2, names, timeout=3000)[0]
    for n in names:
        print(n, "|", " | ".join(map(str, res[n])), flush=True)
