"""Model-quality evaluation: sliding-window perplexity and agreement of a quantized model with its reference."""
