"""scripts/tuning_space.py (the design variants the routers never pick) for the tests that check or run it."""

import importlib.util
from functools import lru_cache
from pathlib import Path


@lru_cache(maxsize=None)
def tuning_space():
    path = Path(__file__).resolve().parents[1] / "scripts" / "tuning_space.py"
    spec = importlib.util.spec_from_file_location("tuning_space", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
