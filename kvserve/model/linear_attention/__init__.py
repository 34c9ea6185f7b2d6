"""Linear-attention token mixers that keep a fixed-size recurrent state per request
(Gated DeltaNet) and the short causal convolution in front of them."""
