"""scripts/engine_rule_pick.py: what a bench run with the unrouted rules proposes to route (E5's row limit, E6, E7)."""

import json

import pytest

from scripts import engine_rule_pick as pick


def _run(points):
    """A `futx bench decode --json` result: points of (batch, {candidate: (ms, spread)})."""
    return {"shape": "llama-3.1-8b", "points": [
        {"batch": b, "context": 1024, "rows": [{"candidate": n, "ms": ms, "spread": sp} for n, (ms, sp) in c.items()]}
        for b, c in points]}


def _point(batch, plain, e5, e6, fmt="int4/int4", spread=0.002, e7=None):
    c = {fmt: (plain, spread), f"{fmt} pdl-attention": (e5, spread), f"{fmt} final-norm-kernel": (e6, spread),
         f"{fmt} gptfast": (9.0, spread)}
    if e7 is not None:
        c[f"{fmt} argmax-kernel"] = (e7, spread)
    return batch, c


def test_e5_routes_up_to_the_batch_before_its_first_loss_and_e6_where_it_wins_and_never_loses():
    rows = pick.comparisons(_run([_point(1, 1.755, 1.70, 1.74), _point(4, 2.44, 2.40, 2.42),
                                  _point(8, 2.55, 2.549, 2.551), _point(32, 5.3, 5.4, 5.25)]))
    assert [r["batch"] for r in rows] == [1, 4, 8, 32]   # "int4/int4 gptfast" is not a plain step
    assert [r["rules"]["E5"]["wins"] for r in rows] == [True, True, False, False]   # (8: within the spreads)
    assert [r["rules"]["E5"]["loses"] for r in rows] == [False, False, False, True]
    # even at 8 rows does not stop E5 (it won at fewer rows), the loss at 32 does; E6 is even at 8 and wins elsewhere
    assert pick.propose(rows) == {"PDL_ATTENTION_MAX_ROWS": 8, "FINAL_NORM_KERNEL": True,
                                  "ARGMAX_KERNEL": False}


def test_a_rule_that_is_only_even_is_not_routed():
    rows = pick.comparisons(_run([_point(1, 1.755, 1.756, 1.754), _point(8, 2.55, 2.549, 2.551)]))
    assert pick.propose(rows) == {"PDL_ATTENTION_MAX_ROWS": 0, "FINAL_NORM_KERNEL": False,
                                  "ARGMAX_KERNEL": False}


def test_a_loss_in_any_format_at_a_batch_stops_e5_there_and_a_slower_e6_stays_off():
    rows = pick.comparisons(_run([_point(1, 1.755, 1.70, 1.77), _point(1, 1.76, 1.80, 1.75, fmt="int4/e4m3")]))
    assert pick.propose(rows) == {"PDL_ATTENTION_MAX_ROWS": 0, "FINAL_NORM_KERNEL": False,
                                  "ARGMAX_KERNEL": False}


def test_e7_where_it_wins_and_never_loses():
    wins = pick.comparisons(_run([_point(1, 1.755, 1.75, 1.75, e7=1.73), _point(8, 2.55, 2.55, 2.55, e7=2.551)]))
    assert pick.propose(wins)["ARGMAX_KERNEL"] is True
    loses = pick.comparisons(_run([_point(1, 1.755, 1.75, 1.75, e7=1.73), _point(8, 2.55, 2.55, 2.55, e7=2.6)]))
    assert pick.propose(loses)["ARGMAX_KERNEL"] is False


def test_the_cli_prints_the_table_and_the_proposal(tmp_path, capsys):
    f = tmp_path / "run.json"
    f.write_text(json.dumps(_run([_point(1, 1.755, 1.70, 1.74)])))
    assert pick.main([str(f)]) == 0
    out = capsys.readouterr().out
    assert "| llama-3.1-8b | 1 | 1024 | int4/int4 | 1.755 | 1.700 (-3.1%) | 1.740 (-0.9%) |" in out
    assert "PDL_ATTENTION_MAX_ROWS = 1" in out and "FINAL_NORM_KERNEL = True" in out


def test_a_file_that_is_not_a_bench_result_is_refused_in_one_line(tmp_path, capsys):
    f = tmp_path / "empty.json"
    f.write_text("")
    with pytest.raises(SystemExit) as e:
        pick.main([str(f)])
    assert e.value.code == 2 and "not a `futx bench decode --json` result" in capsys.readouterr().err


def test_with_several_models_each_gets_its_proposal_and_the_common_one_follows(tmp_path, capsys):
    small, big = _run([_point(1, 1.755, 1.70, 1.74)]), _run([_point(1, 11.5, 11.7, 11.4)])
    big["shape"] = "llama-3.1-70b"
    files = []
    for i, r in enumerate((small, big)):
        files.append(tmp_path / f"{i}.json")
        files[-1].write_text(json.dumps(r))
    assert pick.main([str(f) for f in files]) == 0
    out = capsys.readouterr().out
    assert "llama-3.1-8b: PDL_ATTENTION_MAX_ROWS = 1, FINAL_NORM_KERNEL = True" in out
    assert "llama-3.1-70b: PDL_ATTENTION_MAX_ROWS = 0, FINAL_NORM_KERNEL = True" in out
    assert "PDL_ATTENTION_MAX_ROWS = 0\nFINAL_NORM_KERNEL = True" in out
