"""The HTTP face of kvrecv's bootstrap service, for sglang.

sglang's decode scheduler, its router and its health checks talk HTTP to the
prefill's bootstrap port: ``GET /health``, ``PUT /route`` (a prefill rank
registers), ``GET /route`` (the prefill's parallel info, or one rank),
``POST /register_dp_rank`` and ``POST /query_dp_ranks`` (which prefill DP
group holds a room).  This module answers those routes with the payloads
sglang's own bootstrap server uses, plus ``GET /kvrecv``: the address of
kvrecv's ZMQ rendezvous (the C core's bootstrap server), which kvrecv's
managers learn here instead of from a second well-known port.

Built on the standard library's ``http.server`` (no new dependency, a
parser that is maintained with CPython): request lines and headers are
bounded by it (64 KiB a line, 100 headers); this module bounds bodies
(Content-Length required, at most MAX_BODY bytes), connections (at most
MAX_CONNECTIONS at once, each with a read timeout) and both tables.  Junk
gets a 4xx and the connection is closed.

Rank table: keyed by (DP group, CP rank, TP rank, PP rank), at most MAX_RANKS
entries.  A registration for a key held by another prefill instance
(``instance_id`` differs) is refused with 409 while the holder's endpoint
still accepts connections; once it does not, the new registrant takes the
key (a restarted prefill).  A rank re-registering from the same instance
(a restarted rank) always takes its key.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import threading
import time
from collections import OrderedDict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Dict, Optional, Tuple
from urllib.parse import parse_qs, urlsplit

MAX_BODY = 64 << 10
MAX_CONNECTIONS = 64
MAX_RANKS = 4096
MAX_ROOMS = 1 << 16
ROOM_TTL_S = 600.0
READ_TIMEOUT_S = 5.0
LIVENESS_PROBE_S = 0.3

# PUT /route fields sglang's prefill ranks send, with their type.
_PUT_FIELDS = {
    "attn_tp_size": int, "attn_tp_rank": int, "attn_cp_size": int, "attn_cp_rank": int,
    "attn_dp_size": int, "attn_dp_rank": int, "pp_size": int, "pp_rank": int,
    "system_dp_size": int, "system_dp_rank": int, "rank_ip": str, "rank_port": int,
    "page_size": int,
}


class HTTPError(Exception):
    def __init__(self, status: int, text: str):
        super().__init__(text)
        self.status = status
        self.text = text


@dataclasses.dataclass
class RankEntry:
    rank_ip: str
    rank_port: int
    instance_id: str
    endpoint: str


def _endpoint_alive(ip: str, port: int) -> bool:
    try:
        with socket.create_connection((ip, port), timeout=LIVENESS_PROBE_S):
            return True
    except OSError:
        return False


class RouteTable:
    """sglang's bootstrap state: the prefill's parallel info, its ranks and
    the room -> DP group table.  Thread-safe."""

    def __init__(self, rendezvous: str):
        self.rendezvous = rendezvous
        self.lock = threading.Lock()
        self.info: Dict[str, object] = {}
        self.ranks: Dict[Tuple[int, int, int, int], RankEntry] = {}
        self.rooms: "OrderedDict[int, Tuple[int, float]]" = OrderedDict()

    def put_route(self, data: dict) -> None:
        fields = {}
        for name, kind in _PUT_FIELDS.items():
            if name not in data:
                raise HTTPError(400, f"missing field {name!r}")
            value = data[name]
            if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
                raise HTTPError(400, f"field {name!r} must be an integer")
            if kind is str and not isinstance(value, str):
                raise HTTPError(400, f"field {name!r} must be a string")
            fields[name] = value
        for name in ("attn_tp_size", "attn_cp_size", "attn_dp_size", "pp_size", "system_dp_size"):
            if not 1 <= fields[name] <= MAX_RANKS:
                raise HTTPError(400, f"field {name!r}={fields[name]} is out of range")
        dp_group = fields["attn_dp_rank"] if fields["system_dp_size"] == 1 else fields["system_dp_rank"]
        key = (dp_group, fields["attn_cp_rank"], fields["attn_tp_rank"], fields["pp_rank"])
        instance = str(data.get("instance_id", ""))[:128]
        entry = RankEntry(fields["rank_ip"][:256], fields["rank_port"], instance,
                          str(data.get("kvrecv_endpoint", ""))[:256])
        with self.lock:
            old = self.ranks.get(key)
            if old is None and len(self.ranks) >= MAX_RANKS:
                raise HTTPError(503, f"rank table full ({MAX_RANKS} ranks)")
        if old is not None and old.instance_id != instance and \
                _endpoint_alive(old.rank_ip, old.rank_port):
            raise HTTPError(409, (f"DP{key[0]} CP{key[1]} TP{key[2]} PP{key[3]} is held by live "
                                  f"instance {old.instance_id!r} at {old.rank_ip}:{old.rank_port}"))
        dp_size = fields["attn_dp_size"] if fields["system_dp_size"] == 1 else fields["system_dp_size"]
        info = {
            "attn_tp_size": fields["attn_tp_size"], "attn_cp_size": fields["attn_cp_size"],
            "dp_size": dp_size, "pp_size": fields["pp_size"], "page_size": fields["page_size"],
            "kv_cache_dtype": data.get("kv_cache_dtype"),
            "follow_bootstrap_room":
                data.get("load_balance_method", "follow_bootstrap_room") == "follow_bootstrap_room",
        }
        with self.lock:
            if self.info and any(self.info[k] != info[k] for k in
                                 ("attn_tp_size", "attn_cp_size", "dp_size", "pp_size", "page_size")):
                raise HTTPError(400, f"registration {info} differs from the prefill's {self.info}")
            self.info = info
            self.ranks[key] = entry

    def expected(self) -> int:
        i = self.info
        return i["dp_size"] * i["attn_cp_size"] * i["attn_tp_size"] * i["pp_size"] if i else 0

    def get_route(self, query: Dict[str, list]) -> dict:
        try:
            dp, cp, tp, pp = (int(query[k][0]) for k in
                              ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank"))
        except (KeyError, ValueError, IndexError):
            raise HTTPError(400, "Missing inputs for bootstrap server.") from None
        with self.lock:
            if not self.info or len(self.ranks) < self.expected():
                raise HTTPError(503, f"Prefill server not fully registered yet "
                                     f"({len(self.ranks)} workers registered).")
            if (dp, cp, tp, pp) == (-1, -1, -1, -1):
                return dict(self.info, enable_dsa_cache_layer_split=False,
                            enable_kv_cache_sharding=False, decode_allocation_policy="early")
            entry = self.ranks.get((dp, cp, tp, pp))
        if entry is None:
            raise HTTPError(404, f"Bootstrap info not found for dp_rank={dp} cp_rank={cp} "
                                 f"tp_rank={tp} pp_rank={pp}")
        return {"rank_ip": entry.rank_ip, "rank_port": entry.rank_port}

    def register_dp_rank(self, data: dict) -> None:
        try:
            room, dp = int(data["bootstrap_room"]), int(data["dp_rank"])
        except (KeyError, TypeError, ValueError):
            raise HTTPError(400, "register_dp_rank needs integer bootstrap_room and dp_rank") from None
        now = time.monotonic()
        with self.lock:
            self.rooms.pop(room, None)
            self.rooms[room] = (dp, now)
            while len(self.rooms) > MAX_ROOMS or (
                    self.rooms and now - next(iter(self.rooms.values()))[1] > ROOM_TTL_S):
                self.rooms.popitem(last=False)

    def query_dp_ranks(self, data: dict) -> dict:
        rooms = data.get("bootstrap_rooms")
        if not isinstance(rooms, list):
            raise HTTPError(400, "query_dp_ranks needs a list bootstrap_rooms")
        out = {}
        with self.lock:
            for room in rooms:
                try:
                    hit = self.rooms.get(int(room))
                except (TypeError, ValueError):
                    raise HTTPError(400, f"bootstrap room {room!r} is not an integer") from None
                if hit is not None:
                    out[str(int(room))] = hit[0]
        return out


class _Handler(BaseHTTPRequestHandler):
    server_version = "kvrecv"
    protocol_version = "HTTP/1.1"
    default_request_version = "HTTP/1.0"  # a status line even for junk
    timeout = READ_TIMEOUT_S

    def log_message(self, fmt, *args):  # quiet: sglang polls /health often
        pass

    def _reply(self, status: int, body, content_type: str = "application/json") -> None:
        data = (json.dumps(body) if content_type == "application/json" else str(body)).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        if status >= 400:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(data)

    def _json_body(self) -> dict:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            raise HTTPError(411, "a JSON body with Content-Length is required")
        if int(length) > MAX_BODY:
            raise HTTPError(413, f"body of {length} bytes is over {MAX_BODY}")
        raw = self.rfile.read(int(length))
        try:
            data = json.loads(raw)
        except ValueError:
            raise HTTPError(400, "body is not JSON") from None
        if not isinstance(data, dict):
            raise HTTPError(400, "body is not a JSON object")
        return data

    def _dispatch(self, method: str) -> None:
        table: RouteTable = self.server.table
        url = urlsplit(self.path)
        try:
            if url.path == "/health" and method == "GET":
                return self._reply(200, "OK", "text/plain")
            if url.path == "/kvrecv" and method == "GET":
                return self._reply(200, {"rendezvous": table.rendezvous})
            if url.path == "/route" and method == "GET":
                return self._reply(200, table.get_route(parse_qs(url.query)))
            if url.path == "/route" and method == "PUT":
                table.put_route(self._json_body())
                return self._reply(200, "OK", "text/plain")
            if url.path == "/register_dp_rank" and method == "POST":
                table.register_dp_rank(self._json_body())
                return self._reply(200, "OK", "text/plain")
            if url.path == "/query_dp_ranks" and method == "POST":
                return self._reply(200, table.query_dp_ranks(self._json_body()))
            if url.path in ("/health", "/kvrecv", "/route", "/register_dp_rank", "/query_dp_ranks"):
                raise HTTPError(405, "Method not allowed")
            raise HTTPError(404, f"no route {url.path[:100]!r}")
        except HTTPError as e:
            self._reply(e.status, e.text, "text/plain")

    def do_GET(self):
        self._dispatch("GET")

    def do_PUT(self):
        self._dispatch("PUT")

    def do_POST(self):
        self._dispatch("POST")

    def do_DELETE(self):
        self._dispatch("DELETE")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, addr, table: RouteTable):
        self.table = table
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__(addr, _Handler)

    def process_request(self, request, client_address):
        if not self.slots.acquire(blocking=False):
            self.shutdown_request(request)  # over the connection bound: refused
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


class HTTPBootstrap:
    """sglang's bootstrap routes on (host, port); serves from its own thread."""

    def __init__(self, host: str, port: int, rendezvous: str):
        self.table = RouteTable(rendezvous)
        self._server = _Server((host, port), self.table)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="kvrecv-bootstrap-http", daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(5)
        self._server.server_close()


def fetch_json(addr: str, path: str, timeout: float = 5.0, method: str = "GET",
               body: Optional[dict] = None):
    """One HTTP request to a bootstrap server (stdlib only); returns
    (status, parsed JSON or text)."""
    import http.client

    host, _, port = addr.rpartition(":")
    conn = http.client.HTTPConnection(host.strip("[]"), int(port), timeout=timeout)
    try:
        payload = None if body is None else json.dumps(body)
        headers = {} if body is None else {"Content-Type": "application/json"}
        conn.request(method, path, body=payload, headers=headers)
        resp = conn.getresponse()
        raw = resp.read(MAX_BODY + 1)[:MAX_BODY].decode(errors="replace")
        if resp.getheader("Content-Type", "").startswith("application/json"):
            try:
                return resp.status, json.loads(raw)
            except ValueError:
                pass
        return resp.status, raw
    finally:
        conn.close()
