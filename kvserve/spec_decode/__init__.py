"""Speculative decoding: configuration and torch-free draft proposers."""
