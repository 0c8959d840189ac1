"""The report of benchmarks/faults.py: judging a row, the table between the
faults-table markers of README.md (generated from faults.json, and checked
against it by tests/test_bench_report.py), the figure, the targets."""

from __future__ import annotations

import importlib
import json
import os
import platform
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
README = os.path.join(ROOT, "README.md")
RESULTS = os.path.join(HERE, "results", "faults.json")  # the committed full run
BEGIN, END = "<!-- faults-table:begin -->", "<!-- faults-table:end -->"
NAMES = {"kvrecv": "kvrecv", "nixl": "NIXL", "mooncake": "Mooncake"}
TARGET_S = 1.0

# Words that, found in what the caller received, name the scenario's cause.
CAUSE_WORDS = {
    "kill": ["lost", "closed", "reset", "refused", "died", "disconnect", "unreachable",
             "connection"],
    "freeze": ["heartbeat", "timeout", "timed out", "silent", "unresponsive"],
    "restart": ["restart", "new instance", "lost", "closed", "reset", "disconnect", "connection"],
    "link_down": ["heartbeat", "timeout", "timed out", "unreachable", "link", "lost"],
    "abort": ["abort", "cancel", "deregist", "unregist"],
}


def named(text, words):
    """The first of words found in text (case-insensitive), or None."""
    low = (text or "").lower()
    for w in words:
        if w and str(w).lower() in low:
            return str(w)
    return None


def peer_available(system):
    """None if the system's Python package imports here, else why not."""
    mod = {"kvrecv": "kvrecv._core", "mooncake": "mooncake.engine"}.get(system)
    try:
        if system == "nixl":
            sys.path.insert(0, HERE)
            from nixl_bench import load_nixl

            load_nixl()
        else:
            importlib.import_module(mod)
    except Exception as e:  # noqa: BLE001
        hint = {"nixl": "pip install --no-deps nixl-cu12",
                "mooncake": "pip install --no-deps mooncake-transfer-engine-non-cuda",
                "kvrecv": "python3 setup.py build_ext --inplace"}[system]
        return f"{type(e).__name__}: {str(e)[:200]} ({hint})"
    return None


def versions():
    from importlib import metadata

    out = {}
    for dist in ("nixl-cu12", "mooncake-transfer-engine-non-cuda"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    out["kvrecv_commit"] = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"],
                                          stdout=subprocess.PIPE, text=True).stdout.strip()
    return out


def machine():
    return {"kernel": platform.release(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "loadavg_start": os.getloadavg()}


def size_name(n):
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def verdict(row):
    """kvrecv's target for one row: failure reported within TARGET_S with
    the peer and the cause named, no late byte, the next transfer works."""
    if row["system"] != "kvrecv" or row.get("status") != "ok":
        return None
    d = row.get("detect_s")
    return bool(d is not None and d <= TARGET_S and row.get("names_peer")
                and row.get("names_cause") and row.get("late_bytes") == 0 and row.get("next_ok"))


def received(row):
    w = row.get("what") or {}
    if w.get("class"):
        return w["class"] + (f" {w['code']}" if w.get("code") and w["code"] not in w["class"]
                             else "")
    return f"status {w.get('code')}" if w.get("code") is not None else "-"


def cell(row, cap):
    st = row.get("status", "")
    if st.startswith("not run"):
        return st
    if st == "error":
        return f"could not run: {row.get('error', '')[:160]}"
    d = row.get("detect_s")
    if d is None:
        head = f"no error within {cap:.0f} s"
    else:
        named_ = [x for x, k in (("peer", "names_peer"), ("cause", "names_cause")) if row.get(k)]
        head = (f"{d:.3f} s, {received(row)}, names "
                f"{' and '.join(named_) if named_ else 'neither peer nor cause'}")
    late = row.get("late_bytes")
    nxt = "next transfer ok" if row.get("next_ok") else "next transfer FAILED"
    return f"{head}; {late} late bytes; {nxt}"


def table(res):
    """The README table: one line per scenario, transport and size, one
    column per system."""
    rows = res["rows"]
    systems = [s for s in NAMES if any(r["system"] == s for r in rows)]
    keys = []
    for r in rows:
        k = (r["scenario"], r["transport"], r["size"])
        if k not in keys:
            keys.append(k)
    out = ["| fault | transport | payload | " + " | ".join(NAMES[s] for s in systems) + " |",
           "|---|---|---|" + "---|" * len(systems)]
    for sc, tr, size in keys:
        cells = []
        for s in systems:
            r = next((x for x in rows if (x["scenario"], x["transport"], x["size"], x["system"])
                      == (sc, tr, size, s)), None)
            c = cell(r, res["cap_s"]) if r else "-"
            v = verdict(r) if r else None
            cells.append(c.replace("|", "/") + ("" if v is None else " (PASS)" if v else " (FAIL)"))
        out.append(f"| {sc} | {tr} | {size_name(size)} | " + " | ".join(cells) + " |")
    m = res.get("machine", {})
    out.append("")
    out.append(f"Time: from the fault to the waiting side's API reporting a failure (cap "
               f"{res['cap_s']:.0f} s). Late bytes: bytes that landed in the destination in the "
               f"{res['late_wait_s']:.0f} s after the failure was reported (and the frozen target "
               f"resumed). PASS/FAIL: kvrecv's target (<= {TARGET_S:g} s, peer and cause named, "
               f"0 late bytes, next transfer ok). {m.get('cpus')} CPUs, load "
               f"{(m.get('loadavg_start') or [0])[0]:.1f}; `python benchmarks/faults.py`, "
               f"results in benchmarks/results/faults.json.")
    return "\n".join(out) + "\n"


def readme_block(res):
    return f"{BEGIN}\n{table(res)}{END}"


def readme_current(path=README):
    with open(path) as f:
        text = f.read()
    i, j = text.find(BEGIN), text.find(END)
    if i < 0 or j < 0:
        return None
    return text[i:j + len(END)]


def write_readme(res, path=README):
    with open(path) as f:
        text = f.read()
    i, j = text.find(BEGIN), text.find(END)
    if i < 0 or j < 0:
        print(f"{path} has no {BEGIN} ... {END} block; the table is in faults.md only")
        return
    with open(path, "w") as f:
        f.write(text[:i] + readme_block(res) + text[j + len(END):])


def plot(res, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = sorted({r["transport"] for r in res["rows"]}, key=["tcp", "shm"].index)
    systems = [s for s in NAMES if any(r["system"] == s for r in res["rows"])]
    colors = {"kvrecv": "tab:blue", "nixl": "tab:orange", "mooncake": "tab:green"}
    fig, axes = plt.subplots(len(labels), 1, figsize=(12, 4.2 * len(labels)), squeeze=False)
    cap = res["cap_s"]
    for ax, label in zip(axes[:, 0], labels):
        keys = []
        for r in res["rows"]:
            if r["transport"] == label and (r["scenario"], r["size"]) not in keys:
                keys.append((r["scenario"], r["size"]))
        w = 0.8 / max(1, len(systems))
        for i, s in enumerate(systems):
            for x, (sc, size) in enumerate(keys):
                r = next((y for y in res["rows"] if (y["transport"], y["scenario"], y["size"],
                                                     y["system"]) == (label, sc, size, s)), None)
                if not r or r.get("status") != "ok":
                    ax.text(x + (i - (len(systems) - 1) / 2) * w, 1.2e-3, "n/a", ha="center",
                            fontsize=7, rotation=90)
                    continue
                d = r.get("detect_s")
                ax.bar(x + (i - (len(systems) - 1) / 2) * w, d if d is not None else cap, w,
                       color=colors[s], hatch=None if d is not None else "//",
                       edgecolor="black" if d is None else colors[s],
                       label=NAMES[s] if x == 0 or not ax.get_legend_handles_labels()[1].count(
                           NAMES[s]) else None)
        ax.set_yscale("log")
        ax.set_ylim(1e-3, cap * 2)
        ax.axhline(TARGET_S, color="gray", ls="--", lw=0.8)
        ax.set_xticks(range(len(keys)))
        ax.set_xticklabels([f"{sc}\n{size_name(sz)}" for sc, sz in keys], fontsize=8)
        ax.set_ylabel("s until the API reports it")
        ax.set_title(f"{label}: time to failure (hatched: no error within {cap:.0f} s; "
                     "dashed: 1 s)")
        handles, names = ax.get_legend_handles_labels()
        uniq = dict(zip(names, handles))
        ax.legend(uniq.values(), uniq.keys(), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def row_line(row, cap):
    return (f"  {row['transport']:<4} {row['scenario']:<9} {size_name(row['size']):>7} "
            f"{NAMES[row['system']]:<9} {cell(row, cap)}")


def report(path):
    with open(path) as f:
        res = json.load(f)
    res["targets"] = [{"system": r["system"], "transport": r["transport"], "size": r["size"],
                       "scenario": r["scenario"], "pass": verdict(r)}
                      for r in res["rows"] if r["system"] == "kvrecv"]
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    md = table(res)
    out_dir = os.path.dirname(os.path.abspath(path))
    with open(os.path.join(out_dir, "faults.md"), "w") as f:
        f.write(md)
    if os.path.abspath(path) == RESULTS and not res.get("quick"):
        write_readme(res)
    else:
        print("README table left as it is: it shows the full run in " + os.path.relpath(RESULTS, ROOT))
    try:
        plot(res, os.path.join(out_dir, "faults.png"))
    except ImportError as e:
        print(f"figure not drawn: {e} (pip install matplotlib)")
    print(md)
