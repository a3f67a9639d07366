"""Early-exit causal LMs over transformers weights: partial layer stacks, exit heads, confidence, exit profiles."""
