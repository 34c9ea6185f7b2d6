"""From logits to tokens: the sampler (`sampler`), speculative verification
(`rejection_sampler`), the per-request logit processing that needs request state
(`logits_constraints`: logit_bias, grammar masks) and structured output's grammar
compiler and token masks (`structured`)."""
