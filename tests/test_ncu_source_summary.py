"""scripts/ncu_source_summary.py on a small Nsight Compute source-page CSV of the layout `ncu --page source --csv
--print-source sass` writes (a kernel-name line, the header, one row per SASS instruction)."""

import csv
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import ncu_source_summary as ns  # noqa: E402

HEADER = ["Address", "Source", ns.SAMPLES, "Warp Stall Sampling (Not-issued Samples)", ns.EXECUTED,
          "stall_barrier", "stall_wait", "stall_selected", "stall_barrier (Not Issued)"]
ROWS = [  # address, source, samples, executed, barrier, wait, selected
    ("0x7f0000001000", "BAR.SYNC.DEFER_BLOCKING 0x3, 0x100", 60, 10, 60, 0, 0),
    ("0x7f0000001010", "LOP3.LUT R1, R2, 0xf, RZ, 0xc0, !PT", 20, 40, 0, 15, 5),
    ("0x7f0000001020", "HMMA.16816.F32.BF16 R4, R8, R12, R4", 20, 40, 0, 10, 10),
]


def test_summary_groups_instructions_by_times_run(tmp_path):
    path = tmp_path / "src.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        w.writerow(["Kernel Name", "kernel_x"])
        w.writerow(HEADER)
        for a, src, n, ex, bar, wait, sel in ROWS:
            w.writerow([a, "      " + src, n, n - sel, ex, bar, wait, sel, bar])
    ins = ns.read(str(path))
    assert [i[0] for i in ins] == [0, 0x10, 0x20] and ins[2][1].startswith("HMMA")
    assert ins[0][4] == {"barrier": 60, "wait": 0, "selected": 0}   # the "(Not Issued)" columns left out
    out = ns.report(ins, top=2, groups=5)
    assert "100 samples, 90 warp instructions executed" in out
    assert "barrier 60.0%, wait 25.0%, selected 15.0%" in out
    # the two instructions run 40 times form one group of 40% of the samples, the barrier its own of 60%
    assert "      40 x     2 instr  40.0%      10..    20  wait 62%, selected 38%" in out
    assert "      10 x     1 instr  60.0%       0..     0  barrier 100%" in out
