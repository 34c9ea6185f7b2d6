"""Structured output: constraints compiled into per-vocabulary grammars (`grammar`,
llguidance) and the allowed-token bitmasks applied to the logits (`grammar_mask`)."""
