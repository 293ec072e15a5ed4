"""torch custom ops (`torch.ops.futx.*`) for every public kernel. Importing this package registers them.

Each op validates its inputs before any launch and has a fake (meta) implementation, so ops trace under
`torch.compile(fullgraph=True)` and can be captured in CUDA graphs.
"""

import importlib

_FAMILIES = ("smoke", "prefill", "decode_linear", "decode_attention", "rms_rows", "prefill_attention",
             "mirror_rows", "row_quant", "qkv_rows", "main_rows", "argmax_rows")

for _name in _FAMILIES:
    try:
        importlib.import_module(f"{__name__}.{_name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}.{_name}":
            raise
