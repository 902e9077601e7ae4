"""The hybrid families: decoders whose recurrent layers (Gated DeltaNet, Kimi delta attention, Mamba-2)
keep a fixed-size state per sequence beside their attention layers: Qwen3-Next and the `HybridLayers`
base it shares with Qwen3.5 (dense and MoE), Kimi Linear, Nemotron-H."""
