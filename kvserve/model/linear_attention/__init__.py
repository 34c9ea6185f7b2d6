"""Linear-attention and state-space token mixers that keep a fixed-size recurrent state per
request (Gated DeltaNet, Mamba-2) and the short causal convolution in front of them."""
