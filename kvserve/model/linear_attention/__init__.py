"""Linear-attention and state-space token mixers: layers that keep a fixed-size state per request."""
