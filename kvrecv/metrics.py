"""Prometheus metrics from KVManager.stats().

``prometheus_text(managers)`` returns the text exposition format (version
0.0.4) for any number of managers, each labelled by mode and rank; serve it
from any HTTP endpoint.  If prometheus_client is installed,
``KVRecvCollector(managers)`` yields the same families to its registry
(``KVRecvCollector(mgrs).register()``); prometheus_client is not required
otherwise.

Families (every one labelled by mode and rank):

    kvrecv_rooms{state}                      gauge    open rooms by KVPoll state
    kvrecv_rooms_draining                    gauge    failed rooms still draining
    kvrecv_peers                             gauge    known peers
    kvrecv_pending_requests                  gauge    decode requests held for senders not yet created
    kvrecv_pack_cached_bytes                 gauge    idle packing buffers kept for reuse (prefill, tcp)
    kvrecv_rooms_succeeded_total             counter
    kvrecv_rooms_force_drained_total         counter
    kvrecv_bytes_total                       counter  bytes moved
    kvrecv_rma_ops_total                     counter  data operations posted (prefill)
    kvrecv_failures_total{code}              counter  failures by code
    kvrecv_heartbeats_missed_total           counter
    kvrecv_ctrl_dropped_total                counter  malformed/unexpected control messages dropped
    kvrecv_data_rejected_total               counter  data messages refused by the decode's checks
    kvrecv_log_dropped_total                 counter  log records dropped
    kvrecv_transfer_latency_seconds          histogram  per succeeded room (see below)
    kvrecv_rma_ops_per_room                  histogram  data operations of each succeeded room

The transfer latency of a room is measured by the C core.  On the decode it
runs from sending the room's request (its page indices) to the prefill to the
last byte landed, so it includes the prefill's wait for its own send() calls;
on the prefill it runs from the later of the decode's request arriving and
the last page handed to send() to the decode's completion notice.  Its
buckets are fixed and log-spaced (1-2-5 per decade, 10 us to 100 s), the same
in every process, so they aggregate across ranks and instances.
"""

from __future__ import annotations

from typing import Iterable, List, Tuple

# (family, type, help, stats key)
_SCALARS = [
    ("kvrecv_rooms_draining", "gauge", "Failed rooms whose operations are still draining.", "rooms_draining"),
    ("kvrecv_peers", "gauge", "Peers this manager knows.", "peers"),
    ("kvrecv_pending_requests", "gauge",
     "Decode requests held for prefill senders not created yet.", "pending_requests"),
    ("kvrecv_pack_cached_bytes", "gauge",
     "Idle packing buffers kept for reuse; freed after a second without packed messages.",
     "pack_cached_bytes"),
    ("kvrecv_rooms_succeeded_total", "counter", "Rooms that succeeded.", "rooms_succeeded"),
    ("kvrecv_rooms_force_drained_total", "counter",
     "Rooms declared drained after cancelling operations a dead peer left hanging.",
     "rooms_force_drained"),
    ("kvrecv_bytes_total", "counter", "Bytes moved (KV pages and aux rows).", "bytes_moved"),
    ("kvrecv_rma_ops_total", "counter",
     "Data messages posted by the prefill (a run or coalesced runs, of one or more buffers).",
     "rma_ops_posted"),
    ("kvrecv_heartbeats_missed_total", "counter", "Heartbeats missed.", "heartbeats_missed"),
    ("kvrecv_ctrl_dropped_total", "counter", "Control messages dropped.", "ctrl_dropped"),
    ("kvrecv_data_rejected_total", "counter",
     "Data messages refused by the decode's checks.", "data_rejected"),
    ("kvrecv_log_dropped_total", "counter", "Log records dropped.", "log_dropped"),
    ("kvrecv_data_packed_total", "counter",
     "Scattered data messages sent as a packed contiguous copy (tcp).", "data_packed"),
    ("kvrecv_poll_progressed_total", "counter",
     "UCX events handled by poll() on the scheduler's thread (decode).", "poll_progressed"),
    ("kvrecv_auth_rejected_total", "counter",
     "Control messages refused by authentication.", "auth_rejected"),
    ("kvrecv_ctrl_oversized_total", "counter",
     "Control messages refused for their size.", "ctrl_oversized"),
    ("kvrecv_data_foreign_total", "counter",
     "Data messages for no room of ours or from a sender the room is not bound to.",
     "data_foreign"),
    ("kvrecv_requests_refused_total", "counter",
     "Decode requests refused by the prefill (bad indices, room limits).", "requests_refused"),
    ("kvrecv_data_rendezvous_total", "counter",
     "Data messages the decode accepted that came by rendezvous (the others came eagerly).",
     "data_rendezvous"),
    ("kvrecv_ucx_workers", "gauge", "UCX workers alive (one per connected peer).", "ucx_workers"),
    ("kvrecv_ucx_workers_created_total", "counter",
     "UCX workers created (one per connection to a peer).", "ucx_workers_created"),
]

_ROOMS = ("kvrecv_rooms", "gauge", "Open rooms by KVPoll state.")
_FAILURES = ("kvrecv_failures_total", "counter", "Room failures by code.")
# (family, help, stats key)
_HISTOGRAMS = [
    ("kvrecv_transfer_latency_seconds",
     "Transfer latency of succeeded rooms (decode: request sent to last byte landed; "
     "prefill: request and last page both there to completion).", "transfer_latency"),
    ("kvrecv_rma_ops_per_room", "Data operations of each succeeded room.", "room_ops"),
]

Labels = Tuple[Tuple[str, str], ...]


def _escape(v: str) -> str:
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(pairs) -> str:
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in pairs) + "}"


def _le(bound) -> str:
    """A bucket bound as Prometheus writes it (Go float formatting)."""
    return repr(float(bound))


def _value(v) -> str:
    if isinstance(v, int):
        return str(v)
    return repr(float(v))


def histogram_buckets(hist: dict) -> List[Tuple[str, int]]:
    """[(le, cumulative count), ..., ("+Inf", count)] of one stats()
    histogram (stats() gives per-bucket counts)."""
    out, total = [], 0
    for bound, n in zip(list(hist["bounds"]) + [None], hist["counts"]):
        total += n
        out.append(("+Inf" if bound is None else _le(bound), total))
    return out


def samples(managers: Iterable) -> List[Tuple[str, str, str, list]]:
    """[(family, type, help, [(sample name, labels, value), ...]), ...] for the
    managers (closed ones are skipped).  Histogram families have their
    ``_bucket`` (with ``le``), ``_sum`` and ``_count`` samples."""
    per = []
    for m in managers:
        if getattr(m, "closed", False):
            continue
        base = (("mode", m.mode), ("rank", str(m.kv_args.engine_rank)))
        per.append((base, m.stats()))
    out = []
    name, typ, hlp = _ROOMS
    out.append((name, typ, hlp, [(name, base + (("state", st),), n)
                                 for base, s in per for st, n in s["rooms_by_state"].items()]))
    name, typ, hlp = _FAILURES
    out.append((name, typ, hlp, [(name, base + (("code", code),), n)
                                 for base, s in per for code, n in s["failures_by_code"].items()]))
    for name, typ, hlp, key in _SCALARS:
        out.append((name, typ, hlp, [(name, base, s[key]) for base, s in per]))
    for name, hlp, key in _HISTOGRAMS:
        rows = []
        for base, s in per:
            h = s[key]
            rows += [(name + "_bucket", base + (("le", le),), n) for le, n in histogram_buckets(h)]
            rows.append((name + "_sum", base, h["sum"]))
            rows.append((name + "_count", base, h["count"]))
        out.append((name, "histogram", hlp, rows))
    return out


def prometheus_text(managers: Iterable) -> str:
    """The Prometheus text exposition (0.0.4) of the managers' stats()."""
    lines = []
    for name, typ, hlp, rows in samples(managers):
        lines.append(f"# HELP {name} {hlp}")
        lines.append(f"# TYPE {name} {typ}")
        for sample, labels, value in rows:
            lines.append(f"{sample}{_labels(labels)} {_value(value)}")
    return "\n".join(lines) + "\n"


try:  # optional
    from prometheus_client.core import (  # type: ignore
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )
except ImportError:  # pragma: no cover - depends on the environment
    KVRecvCollector = None  # type: ignore
else:

    class KVRecvCollector:
        """A prometheus_client collector over a list of managers (the list
        is read at every scrape, so ranks may be appended later)."""

        def __init__(self, managers):
            self.managers = managers

        def collect(self):
            for name, typ, hlp, rows in samples(self.managers):
                if typ == "histogram":
                    yield _histogram_family(name, hlp, rows)
                    continue
                keys = [k for k, _ in rows[0][1]] if rows else ["mode", "rank"]
                if typ == "counter":
                    fam = CounterMetricFamily(name[: -len("_total")], hlp, labels=keys)
                else:
                    fam = GaugeMetricFamily(name, hlp, labels=keys)
                for _, labels, value in rows:
                    fam.add_metric([v for _, v in labels], value)
                yield fam

        def describe(self):
            return []

        def register(self, registry=None):
            from prometheus_client import REGISTRY

            (registry or REGISTRY).register(self)
            return self

    def _histogram_family(name, hlp, rows):
        fam = HistogramMetricFamily(name, hlp, labels=["mode", "rank"])
        per: dict = {}  # base labels -> (buckets, sum)
        for sample, labels, value in rows:
            if sample.endswith("_bucket"):
                base = tuple(v for k, v in labels if k != "le")
                per.setdefault(base, [[], 0])[0].append((dict(labels)["le"], value))
            elif sample.endswith("_sum"):
                per.setdefault(tuple(v for _, v in labels), [[], 0])[1] = value
        for base, (buckets, total) in per.items():
            fam.add_metric(list(base), buckets, total)
        return fam
