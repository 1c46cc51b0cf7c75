"""Never silently wrong: every model family is either exact under SP or refused before a step.

Exact families go through ``verify_sequence_parallel`` in fp64 (one process against SP, unpacked
and packed, loss and every parameter's gradient), relative to 1e-12, except where the family
itself computes in fp32 inside an fp64 model: Gemma 3's norms and DeepSeek-V3's router (observed
up to 4e-7 there, 1e-15 elsewhere), held to 1e-6. A rank attending to its own shard only is an
error of order 1 (``verify/planted``).
"""

import pytest

from .conftest import values
from .coverage_cases import MLA_BACKENDS
from .coverage_cases import (BALANCED_FAMILIES, COMPRESSED, INDEXED, LLAMA4_PLANTS, MAMBA2_ADAPTED, MIXER_LAYER_CASES, MLA_BACKENDS, SHRUNK_DEFAULTS, SINK_DEFAULTS, STATE_BALANCED, STATE_PLANTS,
                             STRATEGY_FAMILIES)
from .model_families import EXACT, HYBRID, REFUSED, REFUSED_AT_FORWARD, REFUSED_WITHOUT_MIXER, auto_mixer

TOL = 1e-12
FP32_INSIDE = {"gemma3": 1e-6, "deepseek_v3": 1e-6, "llama4_text": 1e-6, "deepseek_v4": 1e-10}
"""DeepSeek-V4's: its hash-routed MoE gate's gradient differs by 2e-11 between two orders of one process's own sums."""
HYBRID_TOL = 1e-10
"""Gated DeltaNet's A_log and dt_bias gradients sum many cancelling terms: observed up to 6e-12
at fp64 (one process's own re-association noise is of the same order)."""
hf = pytest.mark.skipif(not __import__("importlib").util.find_spec("transformers"), reason="the hf extra (transformers) is not installed")


def _assert_exact(r, name, tol=None):
    tol = tol or FP32_INSIDE.get(name.split("/")[0], TOL)
    assert r["params"] > 5 and (r["attention_params"] or r.get("mixers")), f"{name}: no attention or mixer gradients compared: {r}"
    assert max(r["loss_error"].values()) < tol, (name, r)
    assert r["worst"][2] < tol and r["passed"], (name, r)


@hf
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("lay", ["zigzag", "contiguous"])
@pytest.mark.parametrize("name", EXACT)
@pytest.mark.quick(world=2, lay="zigzag")
def test_family_is_exact(ranks, world, lay, name):
    for r in values(ranks(world), f"families{'-contiguous' if lay == 'contiguous' else ''}/{name}"):
        _assert_exact(r, name)
        assert set(r["backends"]) == {0, 1}, r["backends"]


@hf
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("backend", MLA_BACKENDS)
def test_deepseek_v3_mla_is_exact_under_every_backend(ranks, world, backend):
    for r in values(ranks(world), f"families/deepseek_v3/{backend}"):
        _assert_exact(r, f"deepseek_v3/{backend}")
        assert r["backends"] == {0: [backend], 1: [backend]}


@hf
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.quick(world=2)
def test_uncovered_families_are_refused_by_name(ranks, world):
    for r in values(ranks(world), "families/refused"):
        for name, (module, reason) in REFUSED.items():
            assert r[name].startswith("ValueError: ") and "cannot run under sequence parallelism" in r[name], (name, r[name])
            assert module in r[name] and reason in r[name], (name, r[name])
        for name, (module, reason) in REFUSED_WITHOUT_MIXER.items():
            assert "cannot run under sequence parallelism" in r[name] and module in r[name] and reason in r[name], (name, r[name])
        for name, (module, reason) in REFUSED_AT_FORWARD.items():
            assert r[name].startswith(f"ValueError: {module}{reason}"), (name, r[name])


@hf
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("lay", ["zigzag", "contiguous"])
@pytest.mark.parametrize("name", HYBRID)
@pytest.mark.quick(world=2, lay="zigzag")
def test_hybrid_family_is_exact(ranks, world, lay, name):
    """Gated DeltaNet (Qwen3-Next, Qwen3.5), short convolutions (LFM2), Mamba2 (Bamba, Mamba2, Zamba2's
    Mamba2 layers and the Mamba2 decoder inside its hybrid layers), Kimi Delta Attention (Kimi Linear)
    and RWKV under the strategy auto takes, with the float32 their own code casts to lifted to float64
    (test-only), so the comparison is at fp64's rounding: loss and every gradient, unpacked and packed.
    The strategies are put around the mixers by ulysses_sp/models/token_mixers.py."""
    for r in values(ranks(world), f"hybrids{'-contiguous' if lay == 'contiguous' else ''}/{name}"):
        _assert_exact(r, name, HYBRID_TOL)
        assert r["mixers"] and len(set(r["mixers"].values())) == 1 and set(r["mixers"].values()) <= auto_mixer(name, world), r["mixers"]
        assert r["noise"] < HYBRID_TOL, r  # nothing left in float32: the bound is fp64's


@hf
@pytest.mark.parametrize("lay", ["zigzag", "contiguous"])
@pytest.mark.parametrize("strategy,name,worlds", STRATEGY_FAMILIES)
def test_hybrid_family_is_exact_under_each_mixer_strategy(ranks, lay, strategy, name, worlds):
    """Each strategy beside the one auto takes: Gated DeltaNet, Mamba2 (groups split and replicated)
    and the short convolution, exact in both layouts."""
    for world in worlds:
        for r in values(ranks(world), f"hybrids-{strategy}/{lay}/{name}"):
            _assert_exact(r, name, HYBRID_TOL)
            assert set(r["mixers"].values()) == {strategy}, r["mixers"]


@hf
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("name", BALANCED_FAMILIES)
def test_family_is_exact_under_the_balanced_layout(ranks, world, name):
    """The balanced layout places packed documents by work (verify packs four); the backends and
    mixer strategies read the placement from the batch's document boundaries: loss and every
    gradient against one process, unpacked and packed."""
    for r in values(ranks(world), f"families-balanced/{name}"):
        _assert_exact(r, name, None if name in EXACT else HYBRID_TOL)
        if r.get("mixers"):
            assert len(set(r["mixers"].values())) == 1 and set(r["mixers"].values()) <= auto_mixer(name, world), r["mixers"]


@hf
@pytest.mark.parametrize("name,world", [(name, world) for name, worlds in SINK_DEFAULTS.items() for world in worlds])
@pytest.mark.quick(world=2, name="granite_swa")
def test_families_with_attention_sinks_are_exact(ranks, name, world):
    """Learned sinks (s_aux) beyond GPT-OSS: Granite SWA (P = 2, 3, 4), GraniteMoE SWA, Flint and
    MiMo-V2-Flash, default configs shrunk, float32 lifted: loss and every gradient, sinks' included."""
    for r in values(ranks(world), f"sinks/{name}"):
        _assert_exact(r, name)


@hf
@pytest.mark.parametrize("name,world", [(name, world) for name, (_, _, worlds) in SHRUNK_DEFAULTS.items() for world in worlds])
@pytest.mark.quick(world=2, name="gemma4_text")
def test_gemma4_gemma3n_and_longcat_flash_are_exact(ranks, name, world):
    """Gemma 4 (per-layer head dims and inputs; with its last 12 of 30 layers reusing earlier layers'
    keys and values, keys as values and MoE), Gemma 3n (KV sharing, AltUp, LAuReL) and LongCat-Flash
    (its attention class named ``...MLA``), default configs shrunk with the shared layers kept,
    float32 lifted: loss and every gradient, every attention layer switched."""
    for r in values(ranks(world), f"defaults/{name}"):
        _assert_exact(r, name)
        layers = {"gemma4_text": 6, "gemma4_text-shared-moe": 12, "gemma3n_text": 10, "longcat_flash": 2}[name]
        assert r["layers"] == layers and len(r["backends"]) == layers, r


@hf
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("name", sorted(INDEXED))
@pytest.mark.quick(world=2, name="deepseek_v32")
def test_deepseek_sparse_attention_is_exact_under_the_indexed_strategy(ranks, name, world):
    """DeepSeek-V3.2, GLM-5 (every other layer reusing the choice before it), A.X-K2 and Hy4 (shared indexer layers,
    learned sinks): each rank's queries over the all-gathered latent KV, the indexer choosing 6 of up to 53 keys from
    every rank's, as one process; loss and every gradient at fp64's rounding, unpacked and packed, every attention
    layer under the indexed strategy."""
    for r in values(ranks(world), f"indexed/{name}"):
        _assert_exact(r, name)
        assert r["backends"] == {} and set(r["mixers"].values()) == {"indexed"} and len(r["mixers"]) == r["layers"], r


@hf
@pytest.mark.parametrize("lay", ["contiguous", "balanced"])
def test_deepseek_sparse_attention_is_exact_in_the_other_placements(ranks, lay):
    """Hy4 (shared indexer layers, sinks) under the contiguous and balanced layouts, P=3."""
    for r in values(ranks(3), f"indexed-{lay}/hy_v4"):
        _assert_exact(r, "hy_v4")
        assert set(r["mixers"].values()) == {"indexed"} and len(r["mixers"]) == r["layers"], r


@hf
@pytest.mark.parametrize("world", [2, 3])
def test_deepseek_sparse_attention_is_exact_one_query_a_chunk(ranks, world):
    """Hy4 with the indexer's scores and the attention over the chosen latents computed one query at a time (the
    chunks that bound their memory at long lengths; the attention's recomputed in the backward)."""
    for r in values(ranks(world), "indexed-chunks/hy_v4"):
        _assert_exact(r, "hy_v4")


@hf
def test_an_indexer_choosing_among_its_own_keys_is_caught(ranks):
    """Control: the indexer's choice taken among this rank's keys only (as if its keys were never gathered)."""
    for r in values(ranks(2), "indexed-planted/local-keys"):
        assert not r["passed"] and min(r["loss_error"].values()) > 1e-3, r


@hf
@pytest.mark.parametrize("world", [2, 4])
def test_deepseek_sparse_attention_sends_its_latent_and_indexer_keys_only(ranks, world):
    """Per layer, each rank sends (P - 1) x its tokens x (kv_lora_rank + qk_rope_head_dim) values forward (all-gather) and
    backward (reduce-scatter of their gradient), and (P - 1) x its tokens x index_head_dim forward on a layer with its own
    indexer (GLM-5's shared layers send none); fp64 here."""
    for r in values(ranks(world), "indexed-bytes"):
        per_token = (world - 1) * r["rows"] * r["local"] * 8
        full = r["types"].count("full")
        assert 0 < full < len(r["types"]), r["types"]
        assert r["bytes"] == (per_token * (len(r["types"]) * r["latent"] + full * r["index"]), per_token * len(r["types"]) * r["latent"]), r
        assert r["ops"] == (["all_gather"], ["reduce_scatter"]), r["ops"]


@hf
def test_deepseek_sparse_attention_moves_576_and_128_values_a_token_where_expanded_keys_and_values_are_40960():
    """The estimate on DeepSeek-V3.2's own shapes (a layer built on the meta device): 512 + 64 latent values and 128 indexer
    key values a token forward, the latent's 576 backward; gathering its expanded keys and values would move 128 heads x (192 + 128)."""
    import torch
    import transformers

    from ulysses_sp import Topology
    from ulysses_sp.mixers.indexed import IndexedAttention

    config = transformers.DeepseekV32Config()
    with torch.device("meta"):
        layer = transformers.models.deepseek_v32.modeling_deepseek_v32.DeepseekV32Attention(config, layer_idx=0)
    estimate = IndexedAttention(Topology.for_planning(8)).estimate(layer, batch=1, seq_local=1, hidden=config.hidden_size, itemsize=1)
    assert (estimate.comm_bytes, estimate.bwd_comm_bytes) == (7 * (576 + 128), 7 * 576)
    assert config.num_attention_heads * (config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim) == 40960


@hf
def test_deepseek_v4_without_its_strategy_is_refused_with_what_its_compressed_attention_is():
    import torch
    import transformers

    from ulysses_sp import Topology
    from ulysses_sp.models.shrink import shrink_config
    from ulysses_sp.models.token_mixers import check_supported

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(shrink_config(transformers.DeepseekV4Config()))
    check_supported(model, Topology.for_planning(2))
    with pytest.raises(ValueError, match=r"'compressed_sparse_attention', DeepSeek-V4's compressed sparse attention: keys compressed over "
                                         r"windows of 4 tokens aligned to the row's start \(not to documents"):
        check_supported(model, Topology.for_planning(2), mixer="none")


@hf
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("name", sorted(COMPRESSED))
@pytest.mark.quick(world=2, name="deepseek_v4")
def test_deepseek_v4_is_exact_under_the_compressed_strategy(ranks, name, world):
    """DeepSeek-V4 (its default's layers; one layer of each kind): each chunk with the 7 tokens before it, every rank's
    compressed entries gathered, the indexer choosing 6 of up to 14 entries, as one process; loss and every gradient at
    fp64's rounding, unpacked, every attention layer under the compressed strategy."""
    for r in values(ranks(world), f"compressed/{name}"):
        _assert_exact(r, "deepseek_v4")
        assert r["backends"] == {} and set(r["mixers"].values()) == {"compressed"} and len(r["mixers"]) == r["layers"], r
        assert set(r["loss_error"]) == {"unpacked"}, r["loss_error"]


@hf
@pytest.mark.parametrize("lay", ["contiguous", "balanced"])
def test_deepseek_v4_is_exact_in_the_other_placements(ranks, lay):
    for r in values(ranks(3), f"compressed-{lay}/deepseek_v4-kinds"):
        _assert_exact(r, "deepseek_v4")


@hf
@pytest.mark.parametrize("world", [2, 3])
def test_deepseek_v4_is_exact_one_query_a_chunk(ranks, world):
    """The indexer's scores and the attention computed one query at a time (the attention's recomputed in the backward)."""
    for r in values(ranks(world), "compressed-chunks/deepseek_v4-kinds"):
        _assert_exact(r, "deepseek_v4")


@hf
@pytest.mark.parametrize("case,world", [("compressed-rows/deepseek_v4-kinds", 2), ("compressed-rows/deepseek_v4-kinds", 3),
                                        ("indexed-rows/deepseek_v32", 2)])
def test_own_attention_strategies_are_exact_on_rows_of_unequal_lengths(ranks, case, world):
    """DeepSeek-V4 and DeepSeek-V3.2 on a batch of two rows (23 and 38 tokens at P=3), the shorter padded: loss and every
    gradient against one process running each row alone."""
    for r in values(ranks(world), case):
        assert r["loss_error"] < 1e-12 and r["worst"] < FP32_INSIDE["deepseek_v4"] and r["params"] > 5, r
        assert r["mixers"] == ["compressed" if "v4" in case else "indexed"], r


@hf
def test_every_rank_holds_the_same_gradients_and_calls_its_modules_alike(ranks):
    """What DeepSpeed needs of every rank: the same parameters hold a gradient (it reduces the same set), also on a rank
    that compresses no heavily compressed window, only the indexer's have none, as in one process (its choice takes no
    gradient); and the indexer is called as often (ZeRO-3 gathers its weights at each call), also where a rank's chunk
    is shorter (no halo before the row's start)."""
    got = values(ranks(3), "compressed-alike")
    assert 0 in got[0]["owned"] and all(r == got[0] for r in got), got
    assert got[0]["without"] and all(".indexer." in name for name in got[0]["without"]), got[0]["without"]
    assert got[0]["calls"] == 2 + 2 * 12, got  # its keys once a chunk; then two chunks of at most 12 rows, one query a call


@hf
def test_the_halo_mixer_calls_its_mixer_as_often_on_every_rank(ranks):
    """LFM2 packed, its documents cutting rank 0's first chunk in two: every rank calls the convolution as often (rank 0
    three times a layer, rank 1 twice before), so ZeRO-3's per-call gathers of its weights line up."""
    got = values(ranks(2), "halo-calls-alike")
    assert got[0]["mixers"] == ["halo"] and got[0]["calls"] == got[1]["calls"] == 3, got  # one conv layer, three pieces on rank 0


@hf
def test_an_overlap_dropped_at_a_chunk_start_is_caught(ranks):
    """Control: each chunk's first compressed sparse entry made without the previous window's series."""
    for r in values(ranks(2), "compressed-planted/no-overlap"):
        assert not r["passed"] and r["loss_error"]["unpacked"] > 1e-4, r


@hf
def test_deepseek_v4_refuses_packed_rows_by_name(ranks):
    for message in values(ranks(2), "compressed-packed"):
        assert "packed rows are not supported: DeepSeek-V4 compresses windows aligned to the row's start" in message, message


@hf
@pytest.mark.parametrize("world", [2, 4])
def test_deepseek_v4_sends_halos_and_compressed_entries_only(ranks, world):
    """Per layer (contiguous, 16 tokens a rank): the W - 1 = 7 rows before each rank's (input, positions, RoPE) from the rank
    before forward and the input's gradient back; the all-gather of (P - 1) x the rank's entries (16 / 4 with the indexer's
    keys, 16 / 8) forward and the reduce-scatter of their gradient backward; fp64 here."""
    for r in values(ranks(world), "compressed-bytes"):
        row, reach, layers = 8 * r["rows"], r["window"] - 1, len(r["types"])
        csa, hca = (r["local"] // r["rates"][kind] for kind in ("compressed_sparse_attention", "heavily_compressed_attention"))
        halo = (layers * reach * row * (r["hidden"] + 1 + r["rope"]) if r["rank"] < world - 1 else 0,
                layers * reach * row * r["hidden"] if r["rank"] > 0 else 0)
        assert (r["fwd"].get("send_recv", 0), r["bwd"].get("send_recv", 0)) == halo, r
        assert r["fwd"]["all_gather"] == (world - 1) * row * (csa * (r["head_dim"] + r["index"]) + hca * r["head_dim"]), r
        assert r["bwd"]["reduce_scatter"] == (world - 1) * row * (csa + hca) * r["head_dim"], r
        assert set(r["fwd"]) <= {"send_recv", "all_gather"} and set(r["bwd"]) <= {"send_recv", "reduce_scatter"}, r


@hf
@pytest.mark.parametrize("lay", ["contiguous", "balanced"])
def test_gemma4_shared_layers_are_exact_in_the_other_placements(ranks, lay):
    """Gemma 4 with KV-sharing layers, keys as values and MoE under the contiguous and balanced layouts, P=3."""
    for r in values(ranks(3), f"defaults-{lay}/gemma4_text-shared-moe"):
        _assert_exact(r, "gemma4_text-shared-moe")
        assert r["layers"] == 12 and len(r["backends"]) == 12, r


@hf
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("backend", MLA_BACKENDS)
def test_sink_families_are_exact_under_every_backend(ranks, world, backend):
    """GPT-OSS's sinks on sliding and full layers, and Granite SWA's beside its NoPE full layers, 12
    heads (every backend applies at P = 2, 3, 4), unpacked and packed (verify runs both)."""
    for family in ("gpt_oss", "granite_swa"):
        for r in values(ranks(world), f"sinks/{family}/{backend}"):
            _assert_exact(r, f"{family}/{backend}")
            assert set(map(tuple, r["backends"].values())) == {(backend,)}, r["backends"]


@hf
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("backend", MLA_BACKENDS)
def test_llama4_is_exact_under_every_backend(ranks, world, backend):
    """Llama 4 text: a chunked layer (chunks of 8, cut inside each packed document) and a NoPE layer
    whose query temperature follows the token's global index, float32 lifted, unpacked and packed."""
    for r in values(ranks(world), f"llama4/{backend}"):
        _assert_exact(r, f"llama4/{backend}")
        assert r["backends"] == {0: [backend], 1: [backend]}


@hf
@pytest.mark.parametrize("name", ["llama4", "sinks/gpt_oss"])
def test_llama4_and_gpt_oss_are_exact_under_auto_on_4_ranks(ranks, name):
    """``auto`` at P = 4 (P = 2 and 3: test_family_is_exact)."""
    for r in values(ranks(4), f"{name}/auto"):
        _assert_exact(r, name)


@hf
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("plant", LLAMA4_PLANTS)
def test_llama4_defects_are_caught(ranks, world, plant):
    for r in values(ranks(world), f"llama4-planted/{plant}"):
        assert not r["passed"] and r["worst"][2] > 1e-2, r  # a gradient off by a percent or more


@hf
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", MAMBA2_ADAPTED)
@pytest.mark.quick(world=2, name="falcon_h1")
def test_other_mamba2_mixers_are_exact_under_ulysses(ranks, world, name):
    """Granite 4 (GraniteMoeHybrid), Nemotron-H and Falcon-H1 (with and without its norm) through the
    Mamba2 adapter, their default configs shrunk, float32 lifted: loss and every gradient."""
    for r in values(ranks(world), f"hybrids-adapted/{name}"):
        _assert_exact(r, name, HYBRID_TOL)
        assert r["mixers"] and set(r["mixers"].values()) == {"ulysses"}, r["mixers"]


@hf
@pytest.mark.parametrize("lay", ["zigzag", "contiguous"])
@pytest.mark.parametrize("strategy,name,worlds", MIXER_LAYER_CASES)
def test_mixer_layer_is_exact_and_counts_its_bytes(ranks, lay, strategy, name, worlds):
    """The layer as the model calls it, packed (three documents), against one process: output, input
    gradient, every parameter's gradient (summed over the SP group). Bytes, forward and again
    backward: ulysses, the all-to-all of the projections in and of the output back, (P-1)/P of each;
    halo, the kernel - 1 tokens before each chunk another rank holds. Each equals the strategy's
    estimate (the slowest rank's, for halo)."""
    for world in worlds:
        results = values(ranks(world), f"mixers/{strategy}/{lay}/{name}")
        for r in results:
            assert max(r["errors"]) < 1e-12, r
            assert r["bytes"] == r["by_hand"], r
            if world > 1:
                ops = {"halo": (["send_recv"], ["send_recv"]), "state": (["all_gather"], ["reduce_scatter"])}
                assert r["ops"] == ops.get(strategy, (["all_to_all"], ["all_to_all"])), r
        assert results[0]["estimate"][:2] == tuple(max(r["bytes"][i] for r in results) for i in (0, 1)), results
        share = results[0]["estimate"][2]  # of one process's mixer compute: 1/P, plus the halo rows (2 of 16 per chunk here)
        if strategy == "halo":
            assert 1 / world <= share <= 1.25 / world, share
        else:  # state: and the widened scan for the summaries
            assert share == pytest.approx(results[0]["share"], rel=1e-12), (share, results[0]["share"])


@hf
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("name", MAMBA2_ADAPTED)
def test_other_mamba2_mixers_are_exact_under_state_passing(ranks, world, name):
    """Granite 4, Nemotron-H and Falcon-H1 (with and without its norm) under the state strategy,
    their default configs shrunk, float32 lifted."""
    for r in values(ranks(world), f"hybrids-adapted-state/{name}"):
        _assert_exact(r, name, HYBRID_TOL)
        assert r["mixers"] and set(r["mixers"].values()) == {"state"}, r["mixers"]


@hf
@pytest.mark.parametrize("plant", STATE_PLANTS)
def test_state_passing_defects_are_caught(ranks, plant):
    for r in values(ranks(2), f"mixers-state-planted/{plant}"):
        assert max(r["errors"]) > 1e-3, r


@hf
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("lay", ["zigzag", "contiguous"])
@pytest.mark.parametrize("name", ["qwen3_next_12kh", "bamba_12h"])
def test_state_passing_is_exact_at_the_edges(ranks, world, lay, name):
    """Documents shorter than the convolution's halo, one ending exactly on a chunk boundary, and
    chunks of one token whose halo spans several chunks and ranks: output, input and parameter gradients."""
    for edges, short_chunks in values(ranks(world), f"mixers-state-edges/{lay}/{name}"):
        assert max(edges) < 1e-12 and max(short_chunks) < 1e-12, (edges, short_chunks)


@hf
def test_state_passing_bytes_do_not_grow_with_the_sequence(ranks):
    """A Gated DeltaNet layer under state at 64 and 256 tokens a rank: the same bytes forward and backward
    (the ulysses strategy's grow 4x), each rank's fragments' summaries and convolution tails."""
    for short, long in values(ranks(2), "mixers-state-bytes"):
        assert short == long and short[0] > 0, (short, long)


@hf
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("name", STATE_BALANCED)
def test_state_passing_is_exact_under_the_balanced_layout(ranks, world, name):
    for r in values(ranks(world), f"hybrids-state/balanced/{name}"):
        _assert_exact(r, name, HYBRID_TOL)
        assert set(r["mixers"].values()) == {"state"}, r["mixers"]


@hf
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("strategy,name,worlds", MIXER_LAYER_CASES)
@pytest.mark.quick(world=2)
def test_mixer_bf16_error_does_not_grow_with_ranks(ranks, world, strategy, name, worlds):
    """In bf16 as shipped, against the layer in float64 on the same inputs: relative RMS of the output
    and input gradient at P ranks within 1.3x that at P=1 (the strategies compute each token as one
    process does), and within bf16's epsilon (observed 0.0051-0.0062 at P = 1, 2 and 4, Gated DeltaNet the
    highest: its own code rounds to bf16 inside). The layers go through their adapters:
    models/adapters/gated_deltanet.py (Qwen3-Next), models/adapters/mamba2.py (Bamba),
    models/adapters/kimi_delta.py (Kimi Linear) and models/adapters/short_conv.py (LFM2)."""
    one = values(ranks(1), f"mixers-bf16/{strategy}/{name}")[0]
    for r in values(ranks(world), f"mixers-bf16/{strategy}/{name}"):
        for what in ("out", "dx"):
            assert r[what] <= 1.3 * one[what] and r[what] < 2 ** -7, (what, r, one)


@hf
def test_ulysses_mixer_names_heads_it_cannot_split(ranks):
    for r in values(ranks(3), "mixers/ulysses/refused"):
        assert r["heads"].startswith("ValueError: ulysses: Qwen3NextGatedDeltaNet's 4 heads do not divide by the SP size 3"), r
        assert r["halo"].startswith("ValueError: halo: no reach registered for Qwen3NextGatedDeltaNet"), r
    for r in values(ranks(4), "mixers/ulysses/refused-groups"):
        assert r.startswith("ValueError: ulysses: BambaMixer's 6 head groups and the SP size 4 must divide one another"), r
    for r in values(ranks(2), "mixers/ulysses/all-or-none"):
        assert r["apply"].startswith("ValueError: ulysses: no adapter for _CausalConv"), r
        assert r["left"] == 0, r


@hf
@pytest.mark.parametrize("name", HYBRID)
def test_hybrid_family_as_shipped_passes_verify(ranks, name):
    """As shipped (float32 inside): verify's own tolerance, 10 x the model's rounding noise."""
    for r in values(ranks(2), f"hybrids-shipped/{name}"):
        assert r["passed"] and r["worst"][2] <= r["tolerance"] <= max(1e-6, 10 * r["noise"]), r
        assert r["tolerance"] < 1e-2, r


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("packed", ["unpacked", "packed"])
@pytest.mark.quick(world=2, packed="packed")
def test_allgather_mixer_is_exact_and_counts_its_bytes(ranks, world, packed):
    """A causal convolution under the allgather strategy: output, input gradient and weight
    gradient against one process (documents run one by one when packed), and the bytes: one
    all-gather of the input forward and one reduce-scatter of its gradient backward, (P-1) x its size."""
    for r in values(ranks(world), f"mixers/allgather/{packed}"):
        assert max(r["errors"]) < 1e-13, r
        assert r["bytes"] == r["analytic"] == r["by_hand"], r
        if world > 1:
            assert r["by_op"] == (["all_gather"], ["reduce_scatter"]), r


@hf
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("lay", ["zigzag", "contiguous"])
def test_attention_run_whole_by_a_mixer_is_exact(ranks, world, lay):
    for r in values(ranks(world), f"coverage{'-contiguous' if lay == 'contiguous' else ''}/conv-attention"):
        _assert_exact(r, "conv-attention")
        assert r["mixers"] == {"model.layers.1.self_attn": "allgather"}, r


@hf
@pytest.mark.parametrize("world", [2, 3])
def test_planted_uncovered_layers_raise_on_every_rank(ranks, world):
    results = values(ranks(world), "coverage/planted")  # every rank returned: nothing hung
    assert len(results) == world
    for r in results:
        assert r["mixer attention with a bias"] == ("ValueError: _ConvAttention (layer 1): an additive attention (position) bias is not "
                                                    "supported by ulysses_sp (mixer 'allgather'); use a model without one"), r
    for r in results:
        assert "_OwnAttention (layer 1, model.layers.1.self_attn): computes attention in its own code" in r["own attention"], r
        assert "Conv1d (layer 2, model.layers.2.token_shift): mixes tokens outside attention: a convolution over the sequence (kernel 4)" \
            in r["short convolution"], r
        for form in ("other implementation", "other implementation, compiled"):
            assert "LlamaAttention (layer 1, model.layers.1.self_attn) ran without calling the 'ulysses_sp' attention" in r[form], r
        assert "LlamaConfig (layer 1, config.layer_types[1]): config.layer_types marks this layer 'mamba'" in r["layer type"], r
        assert "_HybridAttentionLayer (layer 1, model.layers.1): computes attention in its own code" in r["attention layer holding a mixer"], r
        assert "needs the global position_ids" in r["no position_ids"], r
        assert r["hooks after remove"] == 0


@hf
@pytest.mark.parametrize("world", [2, 3])
def test_a_layer_dropping_packed_boundaries_is_refused(ranks, world):
    for r in values(ranks(world), "coverage/packed-dropped"):
        assert r["packed"].startswith("ValueError: StableLmAttention (layer 0) did not receive the packed documents' boundaries"), r
        assert r["unpacked"]["passed"] and r["unpacked"]["worst"][2] < 1e-12, r


@hf
def test_verify_catches_a_backend_that_sees_only_its_shard(ranks):
    for r in values(ranks(2), "verify/planted"):
        assert r["planted"].startswith("SequenceParallelMismatch: LlamaForCausalLM under SP=2"), r["planted"]
        assert "MISMATCH" in r["planted"] and "self_attn" in r["planted"].split("worst gradients:")[1], r["planted"]
        assert "MISMATCH" in r["planted mixer"] and ".conv." in r["planted mixer"].split("worst gradients:")[1], r["planted mixer"]
        _assert_exact(r["exact"], "shrunk llama")
        assert r["exact"]["layers"] == 2  # 32 identical layers shrink to two
    # a one-process reference that raises on the rank running it: every rank raises, naming it (they used to wait in a broadcast)
    for r in values(ranks(2), "verify/planted"):
        assert r["reference failed"].startswith("RuntimeError: verify_sequence_parallel: the one-process run of the reference on SP rank 1 "
                                                "failed: ValueError: planted"), r["reference failed"]


@hf
def test_verify_reuses_the_one_process_runs_it_is_given(ranks):
    for r in values(ranks(2), "verify/references"):
        assert r["reused"] and r["one rank lost them"], r
        assert (r["after one call on another backend"], r["after another seed"]) == (1, 2), r
        assert "MISMATCH" in r["planted"] and "self_attn" in r["planted"].split("worst gradients:")[1], r["planted"]


@hf
@pytest.mark.quick
def test_verify_runs_without_dropout_and_leaves_the_model_alone(ranks):
    for r in values(ranks(2), "verify/random"):
        _assert_exact(r["report"], "bert-decoder")
        assert r["kept"] == [0.1], r


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("packed", ["unpacked", "packed"])
@pytest.mark.parametrize("backend", MLA_BACKENDS)
def test_mla_value_head_dim_differs(ranks, world, backend, packed):
    """Value head dim 6 against query/key 12: out, dq, dk, dv at fp64 against the reference; the
    bytes are those of V zero-padded to 12 (what travels; exact, counted)."""
    for r in values(ranks(world), f"mla/{backend}/{packed}"):
        assert max(r["errors"]) < 1e-10, r
        assert r["bytes"] == r["bytes_padded_by_hand"], r
        assert (r["bytes"][0] > 0) == (world > 1), r
        assert r["chosen"] == [backend]


def test_mla_heads_must_agree(ranks):
    for r in values(ranks(2), "mla/errors"):
        assert r["heads differ"].startswith("ValueError: k and v must agree in batch, sequence and heads"), r


@hf
def test_shrink_keeps_every_kind_of_layer():
    """Full-size default configs shrink to the shortest prefix holding each kind of layer (module
    types and layer_types entry), with small widths and multi-head latent attention's unequal dims."""
    import transformers

    from ulysses_sp.models.shrink import shrink_config

    def shrunk(cls):
        small = shrink_config(getattr(transformers, cls)())
        return small, transformers.AutoModelForCausalLM.from_config(small)

    small = shrink_config(transformers.Gemma3TextConfig())
    assert small.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    small, model = shrunk("Qwen3NextConfig")
    assert small.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    small, model = shrunk("DeepseekV3Config")  # three dense MLP layers, then MoE
    assert small.num_hidden_layers == 4 and (small.qk_head_dim, small.v_head_dim) == (12, 6)
    assert sum(p.numel() for p in model.parameters()) < 5e6
    for cls in ("LlamaConfig", "GPT2Config", "MixtralConfig"):
        small, model = shrunk(cls)
        assert small.num_hidden_layers == 2 and sum(p.numel() for p in model.parameters()) < 1e6, cls
    for cls in ("BambaConfig", "Mamba2Config", "NemotronHConfig", "Zamba2Config"):  # verify's 2 x 12 + 5 tokens cross chunks
        _, model = shrunk(cls)
        assert {m.chunk_size for m in model.modules() if hasattr(m, "chunk_size") and hasattr(m, "A_log")} == {8}, cls
    small, model = shrunk("Gemma4TextConfig")  # the full layers' own head dim (512 beside 256) stays twice the others'
    assert [small.per_layer_config[i].head_dim for i in range(6)] == [8] * 5 + [16]
    assert [m.head_dim for m in model.modules() if hasattr(m, "is_kv_shared_layer")] == [8] * 5 + [16]
    small, model = shrunk("Gemma3nTextConfig")  # 35 layers, the last 15 reuse keys and values: 5 of each, the shared ones last
    assert small.num_hidden_layers == 10 and small.num_kv_shared_layers == 5 and small.layer_types[4::5] == ["full_attention"] * 2
    assert len(small.intermediate_size) == len(small.activation_sparsity_pattern) == 10 and sum(p.numel() for p in model.parameters()) < 1e6
    from ulysses_sp.models.shrink import shrink_text  # an image-text model's text config: Gemma 4 with its last 12 layers sharing KV
    text = shrink_text(transformers.Gemma4TextConfig(num_kv_shared_layers=12))
    assert text.num_hidden_layers == 12 and text.num_kv_shared_layers == 6 and text.kv_sharing_modes[6:] == ["reuse"] * 6


def test_mixers_survive_transformers_kernelize(ranks):
    """from_pretrained turns transformers' Hub kernels on (its ``kernels`` dependency); train()/eval() then
    re-kernelize and drop each kernel-decorated module's instance forward, which silently ran Qwen3.5's Gated
    DeltaNet on each rank's shard alone until the mixers' pre-hook put theirs back (found under TRL's DPO)."""
    for r in values(ranks(2), "mixers/kernelized"):
        assert r["use_kernels"], "the model must have been kernelized, else this proves nothing"
        assert r["loss"] < 1e-12 and r["grad"] < 1e-10, r


@hf
def test_state_passing_refuses_rwkv_by_name_and_says_why():
    """RWKV-4's WKV state (numerator, denominator, running maximum) is affine only in exp space; its
    feed-forward mixes through a one-token shift: state names the class and the reason for each."""
    import transformers

    from ulysses_sp.mixers import get_mixer

    from .model_families import config

    block = transformers.AutoModelForCausalLM.from_config(config("rwkv")).rwkv.blocks[0]
    with pytest.raises(ValueError, match=r"state: not for RwkvSelfAttention: .*exp space"):
        get_mixer("state", None, block.attention)
    with pytest.raises(ValueError, match=r"state: not for RwkvFeedForward: .*one-token shift"):
        get_mixer("state", None, block.feed_forward)


def test_a_shadowed_forward_puts_back_what_was_there():
    """The indexed and compressed strategies shadow a submodule's forward for one call: an instance forward installed by
    others (accelerate's hooks) is put back afterwards, not dropped; a module without one is left without one."""
    import torch

    from ulysses_sp.mixers.common import shadowed_forward

    hooked, plain = torch.nn.Identity(), torch.nn.Identity()
    hook = hooked.__dict__["forward"] = lambda x: x + 1
    for module in (hooked, plain):
        with shadowed_forward(module, lambda x: x * 0):
            assert module(torch.ones(1)).item() == 0
    assert hooked.__dict__["forward"] is hook and hooked(torch.ones(1)).item() == 2 and "forward" not in plain.__dict__


def test_a_modules_parameters_are_counted_whole_under_zero3():
    """ZeRO-3 leaves a partitioned parameter empty outside its module's call (its size in ds_numel): auto's estimates
    divided by the mixer's parameter count, 0 there (MiniMax and Kimi Linear stopped at their first call under ZeRO-3)."""
    import torch

    from ulysses_sp.mixers.common import parameter_count

    layer = torch.nn.Linear(4, 4)
    assert parameter_count(layer) == 20
    for p in layer.parameters():
        p.ds_numel, p.data = p.numel(), torch.empty(0)
    assert parameter_count(layer) == 20
