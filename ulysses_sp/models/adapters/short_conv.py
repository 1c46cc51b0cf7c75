"""The reach of the short-convolution layers the halo mixer runs: LFM2's (``Lfm2ShortConv``, and
LFM2-MoE's and LFM3's, whose forwards are the same): per-token projections around a depthwise
causal convolution, so each output sees its token and the ``kernel - 1`` before it."""

from __future__ import annotations

from ...mixers.halo import register_reach

register_reach(("Lfm2ShortConv", "Lfm2MoeShortConv", "Lfm3ShortConv"), lambda module: module.conv_kernel_size - 1)
