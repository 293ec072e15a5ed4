"""CPU checks of the decode projections: variant choice, op validation and fake kernels, and the SASS of
representative variants (every registry variant is also compiled by test_kernel_compile.py)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from decode import plan
from futx.config import preset
from futx.runtime import get_spec

SHAPES = [preset(p).projection_shapes()[proj] + (64 if p.startswith("smollm2") else 128,)
          for p in ("layer-1b", "layer-8b", "layer-70b", "smollm2-135m") for proj in ("qkv", "o", "gate_up", "down")]


@pytest.mark.parametrize("fmt", plan.FORMATS)
@pytest.mark.parametrize("m", [1, 2, 3, 8, 9, 16, 17, 31, 32])
def test_every_shape_picks_a_registered_variant_and_a_valid_split(fmt, m):
    for n, k, group in SHAPES:
        for epilogue in plan.EPILOGUES:
            choice = plan.choose(fmt, group, epilogue, m, n, k)
            assert get_spec(choice.key).ci
            units = k // plan.unit_k(fmt, group)
            assert 1 <= choice.split <= max(1, units // plan.MIN_UNITS)  # every CTA keeps a few units


def test_plan_rejects_what_no_kernel_serves():
    with pytest.raises(ValueError, match="1 <= M <= 32"):
        plan.m_bucket(33)
    with pytest.raises(ValueError, match="1 <= M <= 32"):
        plan.m_bucket(0)
    with pytest.raises(ValueError, match="group size 256"):
        plan.fmt_tag("int4", 256)
    with pytest.raises(ValueError, match="unknown decode weight format"):
        plan.fmt_tag("int8")


def test_ops_reject_cpu_tensors_before_launch():
    import futx.ops  # noqa: F401

    x = torch.zeros(1, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA"):
        torch.ops.futx.decode_linear_bf16(x, torch.zeros(16, 128, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="CUDA"):
        torch.ops.futx.decode_linear_int4(x, torch.zeros(1, 2, 32, 4, dtype=torch.int32),
                                          torch.zeros(1, 1, 16, dtype=torch.float16), 128)


def test_fake_kernels_give_output_shapes():
    import futx.ops  # noqa: F401

    with torch._subclasses.fake_tensor.FakeTensorMode():
        x = torch.empty(5, 4096, dtype=torch.bfloat16, device="cuda")
        packed = torch.empty(6144 // 16, 64, 32, 4, dtype=torch.int32, device="cuda")
        scales = torch.empty(6144 // 16, 32, 16, dtype=torch.float16, device="cuda")
        assert torch.ops.futx.decode_linear_int4(x, packed, scales, 128).shape == (5, 6144)
        assert torch.ops.futx.decode_linear_int4(x, packed, scales, 128, "swiglu").shape == (5, 3072)
        data = torch.empty(512, 4096, dtype=torch.float8_e4m3fn, device="cuda")
        scale = torch.empty(512, dtype=torch.float32, device="cuda")
        assert torch.ops.futx.decode_linear_e4m3(x, data, scale).shape == (5, 512)


# ---- SASS of representative variants ----------------------------------------------------------
def _sass(key: str, tmp_path: Path) -> str:
    pytest.importorskip("cutlass")
    import subprocess
    import sys

    code = ("import sys; from futx.runtime import compile_spec, get_spec; compile_spec(get_spec(sys.argv[1]))")
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="sass", CUTE_DSL_DUMP_DIR=str(tmp_path))
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    subprocess.run([sys.executable, "-c", code, key], check=True, env=env, cwd=root, timeout=600)
    return "\n".join(p.read_text() for p in tmp_path.glob("*.sass"))


def _ops(sass: str) -> list[str]:
    return re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)


@pytest.mark.slow
def test_int4_gemv_sass(tmp_path):
    ops = _ops(_sass("decode.gemv.int4.store", tmp_path))
    n = {op: ops.count(op) for op in set(ops)}
    hmma = sum(v for op, v in n.items() if op.startswith("HMMA.16816.F32.BF16"))
    bias_fma = sum(v for op, v in n.items() if op.startswith("HFMA2.BF16"))
    stream = sum(v for op, v in n.items() if op.startswith("LDG.E") and ".128" in op)
    assert hmma and stream, n
    assert bias_fma == 4 * hmma, "one packed bf16 FMA per nibble pair: 4 pairs per word, one word per MMA"
    assert not any(op.startswith(("LDL", "STL")) for op in ops), "local-memory spills"


@pytest.mark.slow
@pytest.mark.parametrize("key,expect", [("decode.gemv.e4m3.residual", ("HMMA", "HMUL2.BF16")),
                                        ("decode.skinny.int4.m32.swiglu", ("HMMA", "LDGSTS", "LDSM", "SHFL")),
                                        ("decode.skinny.bf16.m16.store", ("HMMA", "LDGSTS", "LDS.128"))])
def test_variant_sass(tmp_path, key, expect):
    ops = _ops(_sass(key, tmp_path))
    for want in expect:
        assert any(op.startswith(want) for op in ops), f"{key}: no {want} in SASS"
    assert not any(op.startswith(("LDL", "STL")) for op in ops), f"{key}: local-memory spills"
