"""Model-quality evaluation: sliding-window perplexity and agreement of a quantized model with its reference."""

# The commands' defaults, here so that kvserve.eval.cli builds its flags without importing torch.
PPL_MAX_TOKENS = 16384  # tokens of the dataset scored
PPL_WINDOW = 1024  # tokens per model call
PPL_STRIDE = 512  # tokens between window starts
AGREE_NUM_PROMPTS = 16
AGREE_MAX_TOKENS = 64  # greedy tokens the reference generates per prompt
AGREE_MAX_PROMPT_LEN = 256
