"""The README's fault table is the one generated from the committed
benchmarks/results/faults.json (python benchmarks/faults.py --report-only);
the throughput report's ratios by round and over repeated suite runs."""

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import faults_report as R  # noqa: E402
import report as REP  # noqa: E402

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


# ---- the throughput report: kv/NIXL by round, and over repeated suite runs ----


def _point(name, kv, nixl):
    return {"name": name, "point": {"layout": "random", "nbuf": 64, "item": 65536, "pages": 16,
                                    "rooms": 2},
            "msg_size": 65536, "kvrecv": {"gbps": REP.C.median(kv), "gbps_all": kv},
            "nixl": {"gbps": REP.C.median(nixl), "gbps_all": nixl}}


def _run(kv, nixl):
    return {"machine": {"time": "t", "loadavg_start": [0.1, 0, 0], "cpu": "x", "cpus": 2,
                        "memory_bytes": 2**30, "kernel": "k", "ucx": ["# UCX 1.13"],
                        "python": "3", "kvrecv_commit": "0123456789ab",
                        "kvrecv_tree_dirty": False},
            "loadavg_end": [0.2, 0, 0], "quick": False,
            "transports": {"shm": {"points": [_point("random-b64-i64k-p16-r2", kv, nixl)]}}}


def test_round_ratios_pair_rounds_in_the_order_taken():
    # kvrecv's rounds against the NIXL round taken right after each: the
    # ratio of medians (2/2 = 1) hides that every pair but one lost
    rr = REP.round_ratios(_point("p", [1.0, 2.0, 3.0, 4.0, 5.0], [2.0, 4.0, 1.0, 8.0, 2.0]))
    assert rr["all"] == [0.5, 0.5, 3.0, 0.5, 2.5]
    assert (rr["median"], rr["min"], rr["max"]) == (0.5, 0.5, 3.0)
    assert REP.fmt_spread(rr) == "0.50 [0.50-3.00]"
    assert REP.round_ratios({"name": "p", "kvrecv": {"gbps_all": [1.0]}}) is None
    assert REP.fmt_spread(None) == "-"


def test_repeat_reports_the_worst_median_per_point_and_judges_it():
    runs = [_run([2.0, 2.0, 2.0], [1.0, 1.0, 1.0]),   # medians 2.0
            _run([1.0, 0.9, 3.0], [1.0, 1.0, 1.0]),   # 1.0, lowest round 0.9
            _run([1.5, 1.5, 1.5], [1.0, 1.0, 1.0])]   # 1.5
    res = runs[-1]
    res["repeats"] = [REP.repeat_record(r) for r in runs]
    res["targets"] = REP.evaluate(res)
    (row,) = REP.repeat_rows(res)
    assert row["medians"] == [2.0, 1.0, 1.5]
    assert (row["worst_median"], row["min"], row["max"]) == (1.0, 0.9, 3.0)
    (t,) = [t for t in res["targets"] if t["target"].startswith("every point")]
    assert t["case"] == "shm random-b64-i64k-p16-r2" and t["ratio"] == 1.0 and t["pass"] is True
    md = REP.summary_md(res)
    assert "### kv/NIXL over 3 runs of the whole suite (--repeat 3)" in md
    assert "| shm | random-b64-i64k-p16-r2 | 2.00 1.00 1.50 | 1.00 | 0.90-3.00 |" in md
    # one run below 1x fails the point, whatever the others did
    res["repeats"][1]["points"]["shm"]["random-b64-i64k-p16-r2"]["kvrecv"]["gbps_all"] = [0.5] * 3
    (t,) = [t for t in REP.evaluate(res) if t["target"].startswith("every point")]
    assert t["ratio"] == 0.5 and t["pass"] is False


def test_a_run_without_nixl_figures_has_no_worst_median():
    runs = [_run([2.0], [1.0]), _run([2.0], [1.0])]
    runs[1]["transports"]["shm"]["points"][0]["nixl"] = {"error": "did not start"}
    res = runs[-1]
    res["repeats"] = [REP.repeat_record(r) for r in runs]
    (row,) = REP.repeat_rows(res)
    assert row["medians"] == [2.0, None] and row["worst_median"] is None
    assert not [t for t in REP.evaluate(res) if t["target"].startswith("every point")]
