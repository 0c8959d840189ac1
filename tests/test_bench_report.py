"""The README's fault table is the one generated from the committed
benchmarks/results/faults.json (python benchmarks/faults.py --report-only)."""

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import faults_report as R  # noqa: E402

RESULTS = R.RESULTS


@pytest.mark.skipif(not os.path.exists(RESULTS), reason="no benchmarks/results/faults.json")
def test_readme_fault_table_matches_results():
    with open(RESULTS) as f:
        res = json.load(f)
    assert R.readme_current() == R.readme_block(res), (
        "README.md's faults-table block differs from benchmarks/results/faults.json: "
        "run python benchmarks/faults.py --report-only")


def test_a_row_without_failure_within_the_cap_says_so_and_fails_the_target():
    row = {"system": "kvrecv", "transport": "tcp", "size": 4096, "scenario": "freeze",
           "status": "ok", "detect_s": None, "late_bytes": 0, "next_ok": True}
    assert R.cell(row, 45).startswith("no error within 45 s; 0 late bytes")
    assert R.verdict(row) is False
    row.update(detect_s=0.6, names_peer="decode rank 0", names_cause="heartbeat", late_bytes=4096,
               what={"class": "KVPeerLostError", "code": "PEER_LOST"})
    assert R.verdict(row) is False  # a late byte fails it
    row["late_bytes"] = 0
    assert R.verdict(row) is True
    assert R.named("decode rank 0 lost: no heartbeat for 601 ms", R.CAUSE_WORDS["freeze"]) == "heartbeat"


@pytest.mark.skipif(not os.path.exists(RESULTS), reason="no benchmarks/results/faults.json")
def test_a_report_of_another_results_file_leaves_the_readme_table_alone(tmp_path):
    with open(RESULTS) as f:
        res = json.load(f)
    for row in res["rows"]:
        row["status"] = "not run: a copy"
    other = tmp_path / "faults.json"
    other.write_text(json.dumps(res))
    with open(R.README) as f:
        before = f.read()
    R.report(str(other))
    with open(R.README) as f:
        assert f.read() == before
    assert "not run: a copy" in (tmp_path / "faults.md").read_text()
