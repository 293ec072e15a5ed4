"""The perplexity protocols' names and the default window (futx.eval.perplexity describes them), and those the
decode engine runs (futx.engine.perplexity); no torch, so the command line can check them before anything loads."""

PROTOCOLS = ("gptq", "serving", "all-decode")
ENGINE_PROTOCOLS = ("all-decode", "serving")
WINDOW = 2048
