"""Prometheus metrics from KVManager.stats().

``prometheus_text(managers)`` returns the text exposition format (version
0.0.4) for any number of managers, each labelled by mode and rank; serve it
from any HTTP endpoint.  If prometheus_client is installed,
``KVRecvCollector(managers)`` yields the same families to its registry
(``KVRecvCollector(mgrs).register()``); prometheus_client is not required
otherwise.

Families:

    kvrecv_rooms{mode,rank,state}            gauge    open rooms by KVPoll state
    kvrecv_rooms_draining{mode,rank}         gauge    failed rooms still draining
    kvrecv_peers{mode,rank}                  gauge    known peers
    kvrecv_pending_requests{mode,rank}       gauge    decode requests held for senders not yet created
    kvrecv_rooms_succeeded_total{mode,rank}  counter
    kvrecv_rooms_force_drained_total{mode,rank} counter
    kvrecv_bytes_total{mode,rank}            counter  bytes moved
    kvrecv_rma_ops_total{mode,rank}          counter  data operations posted
    kvrecv_failures_total{mode,rank,code}    counter  failures by code
    kvrecv_heartbeats_missed_total{mode,rank} counter
    kvrecv_ctrl_dropped_total{mode,rank}     counter  malformed/unexpected control messages dropped
    kvrecv_data_rejected_total{mode,rank}    counter  data messages refused by the decode's checks
    kvrecv_log_dropped_total{mode,rank}      counter  log records dropped
"""

from __future__ import annotations

from typing import Iterable, List, Tuple

# (family, type, help, stats key or None for the labelled ones)
_SCALARS = [
    ("kvrecv_rooms_draining", "gauge", "Failed rooms whose operations are still draining.", "rooms_draining"),
    ("kvrecv_peers", "gauge", "Peers this manager knows.", "peers"),
    ("kvrecv_pending_requests", "gauge",
     "Decode requests held for prefill senders not created yet.", "pending_requests"),
    ("kvrecv_rooms_succeeded_total", "counter", "Rooms that succeeded.", "rooms_succeeded"),
    ("kvrecv_rooms_force_drained_total", "counter",
     "Rooms declared drained after cancelling operations a dead peer left hanging.",
     "rooms_force_drained"),
    ("kvrecv_bytes_total", "counter", "Bytes moved (KV pages and aux rows).", "bytes_moved"),
    ("kvrecv_rma_ops_total", "counter", "Data operations posted.", "rma_ops_posted"),
    ("kvrecv_heartbeats_missed_total", "counter", "Heartbeats missed.", "heartbeats_missed"),
    ("kvrecv_ctrl_dropped_total", "counter", "Control messages dropped.", "ctrl_dropped"),
    ("kvrecv_data_rejected_total", "counter",
     "Data messages refused by the decode's checks.", "data_rejected"),
    ("kvrecv_log_dropped_total", "counter", "Log records dropped.", "log_dropped"),
    ("kvrecv_auth_rejected_total", "counter",
     "Control messages refused by authentication.", "auth_rejected"),
    ("kvrecv_ctrl_oversized_total", "counter",
     "Control messages refused for their size.", "ctrl_oversized"),
    ("kvrecv_data_foreign_total", "counter",
     "Data messages for no room of ours or from a sender the room is not bound to.",
     "data_foreign"),
    ("kvrecv_requests_refused_total", "counter",
     "Decode requests refused by the prefill (bad indices, room limits).", "requests_refused"),
]

_ROOMS = ("kvrecv_rooms", "gauge", "Open rooms by KVPoll state.")
_FAILURES = ("kvrecv_failures_total", "counter", "Room failures by code.")


def _escape(v: str) -> str:
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(pairs) -> str:
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in pairs) + "}"


def samples(managers: Iterable) -> List[Tuple[str, str, str, list]]:
    """[(family, type, help, [(labels, value), ...]), ...] for the managers
    (closed ones are skipped)."""
    per = []
    for m in managers:
        if getattr(m, "closed", False):
            continue
        base = (("mode", m.mode), ("rank", str(m.kv_args.engine_rank)))
        per.append((base, m.stats()))
    out = []
    name, typ, hlp = _ROOMS
    out.append((name, typ, hlp, [(base + (("state", st),), n)
                                 for base, s in per for st, n in s["rooms_by_state"].items()]))
    name, typ, hlp = _FAILURES
    out.append((name, typ, hlp, [(base + (("code", code),), n)
                                 for base, s in per for code, n in s["failures_by_code"].items()]))
    for name, typ, hlp, key in _SCALARS:
        out.append((name, typ, hlp, [(base, s[key]) for base, s in per]))
    return out


def prometheus_text(managers: Iterable) -> str:
    """The Prometheus text exposition (0.0.4) of the managers' stats()."""
    lines = []
    for name, typ, hlp, rows in samples(managers):
        lines.append(f"# HELP {name} {hlp}")
        lines.append(f"# TYPE {name} {typ}")
        for labels, value in rows:
            lines.append(f"{name}{_labels(labels)} {int(value)}")
    return "\n".join(lines) + "\n"


try:  # optional
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily  # type: ignore

    class KVRecvCollector:
        """A prometheus_client collector over a list of managers (the list
        is read at every scrape, so ranks may be appended later)."""

        def __init__(self, managers):
            self.managers = managers

        def collect(self):
            for name, typ, hlp, rows in samples(self.managers):
                keys = [k for k, _ in rows[0][0]] if rows else ["mode", "rank"]
                if typ == "counter":
                    fam = CounterMetricFamily(name[: -len("_total")], hlp, labels=keys)
                else:
                    fam = GaugeMetricFamily(name, hlp, labels=keys)
                for labels, value in rows:
                    fam.add_metric([v for _, v in labels], value)
                yield fam

        def describe(self):
            return []

        def register(self, registry=None):
            from prometheus_client import REGISTRY

            (registry or REGISTRY).register(self)
            return self

except ImportError:  # pragma: no cover - depends on the environment
    KVRecvCollector = None  # type: ignore
