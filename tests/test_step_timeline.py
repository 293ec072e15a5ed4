"""CPU check of scripts/step_timeline.py's analysis: steps split at long gaps, busy time as the union of kernel
intervals, idle gaps and PDL overlap counted, busy time by kind of kernel."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import step_timeline as st  # noqa: E402


def test_timeline_of_two_steps():
    one = [(0.0, 10.0, "kernel_GemvTileNorm_x"), (8.0, 15.0, "kernel_DecodeAttention_y"),   # 2 us overlap
           (17.0, 20.0, "kernel_GemvTile_z")]                                               # 2 us idle
    two = [(t0 + 100.0, t1 + 100.0, n) for t0, t1, n in one]
    steps = st.steps_of(two + one)
    assert [len(s) for s in steps] == [3, 3]
    a = st.analyse(steps[0])
    assert a["span_us"] == 20.0 and a["busy_us"] == 18.0 and a["idle_us"] == 2.0 and a["overlap_us"] == 2.0
    assert a["idle_gaps"] == 1 and a["mean_idle_gap_us"] == 2.0
    assert sum(a["kernel_us_by_name"].values()) == 20.0
    assert a["kernel_us_by_kind"] == {"rms+qkv / rms+gate-up (tile GEMV, fused norm)": 10.0, "attention": 7.0,
                                      "o / down (tile GEMV, residual)": 3.0}


def test_rules_off_beside_a_rule_is_refused_before_torch(monkeypatch, capsys):
    import pytest

    monkeypatch.setattr(sys, "argv", ["step_timeline.py", "--rules-off", "--final-norm-kernel"])
    with pytest.raises(SystemExit) as e:
        st.main()
    assert e.value.code == 2 and "--rules-off turns off the rules" in capsys.readouterr().err


def test_traced_rules_are_the_ones_asked_for():
    """Both rules asked for trace their union (each rule's own bench candidate has the other one off)."""
    import argparse

    def rules(**kw):
        flags = dict(pdl_attention=False, final_norm_kernel=False, argmax_kernel=False, rules_off=False, batch=4)
        return st.timeline_rules(argparse.Namespace(**{**flags, **kw}))

    assert rules(pdl_attention=True, final_norm_kernel=True) == {"pdl_attention_rows": 4, "final_norm_kernel": True}
    assert rules(pdl_attention=True) == {"pdl_attention_rows": 4}
    assert rules(final_norm_kernel=True) == {"final_norm_kernel": True}
    assert rules(argmax_kernel=True, final_norm_kernel=True) == {"final_norm_kernel": True, "argmax_kernel": True}
    assert rules(rules_off=True) == {"pdl_attention_rows": 0, "final_norm_kernel": False, "argmax_kernel": False}
    assert rules() == {}
