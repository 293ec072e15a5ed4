"""Every kernel family's registry entries. Each submodule defines SPECS and imports no DSL code.

Adding a family: create `<family>.py` here with a SPECS list and add it to FAMILIES.
"""

import importlib

from futx.runtime.registry import register

FAMILIES = ("smoke", "prefill", "decode_linear", "decode_attention", "engine", "prefill_attention", "persistent")

PACKAGE_SPECS = []   # what ships: every family's SPECS (the registry may gain entries at run time)
for _name in FAMILIES:
    try:
        _mod = importlib.import_module(f"{__name__}.{_name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}.{_name}":
            raise
        continue  # family not written yet
    PACKAGE_SPECS += _mod.SPECS
    register(*_mod.SPECS)
