"""The perplexity protocols' names and the default window (futx.eval.perplexity describes them); no torch, so
the command line can offer them before anything loads."""

PROTOCOLS = ("gptq", "serving", "all-decode")
WINDOW = 2048
