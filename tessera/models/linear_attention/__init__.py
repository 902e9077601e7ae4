"""Linear-attention token mixers of hybrid decoders (a fixed-size recurrent state per sequence
instead of a growing key/value cache): `delta_rule.py` holds the gated delta rule's chunked and
recurrent forms (a decay per head or per key channel) and the short causal convolution,
`gated_deltanet.py` the Gated DeltaNet layer (Qwen3-Next, Qwen3.5) and `kimi_delta_attention.py`
Kimi delta attention (Kimi Linear), both built on them; `ssd.py` Mamba-2's state space duality in its
chunked and recurrent forms, `mamba2.py` the Mamba-2 mixer (Nemotron-H) built on it and the same
convolution; `handoff.py` both recurrences run over a part of a sequence from the state the part before
it hands on (context parallelism's seam); `states.py` what each mixer keeps per sequence for serving."""
