"""What each token-mixer family registers with the `ulysses_sp.mixers` strategies, one module per
family: Ulysses adapters (heads split at the projections) for Gated DeltaNet, Mamba2 and Kimi
Delta Attention, the halo reach of short convolutions, MiniMax's final state. Importing the
package registers them all."""

from . import gated_deltanet, kimi_delta, mamba2, minimax, short_conv  # noqa: F401
