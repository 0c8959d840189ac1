"""The loopback demo: a bootstrap server, a prefill instance (one child
process, N ranks) and a decode instance (this process, N ranks) move a
synthetic KV cache for many rooms and verify every byte."""

from __future__ import annotations

import argparse
import functools
import multiprocessing as mp
import sys
import time

import numpy as np

from ._api import BootstrapServer, KVArgs, KVConfig, KVManager, KVPoll, KVReceiver, KVSender

AUX_ITEM = 64


def _layout(args):
    items = [args.item_len * (1 + (i % 2)) for i in range(args.buffers)]
    return items


def _buffers(rank: int, seed: int, args):
    rng = np.random.default_rng(seed * 1000 + rank)
    items = _layout(args)
    kv = [rng.integers(0, 256, size=args.pages_per_buffer * it, dtype=np.uint8) for it in items]
    aux = [rng.integers(0, 256, size=args.slots * AUX_ITEM, dtype=np.uint8)]
    return kv, items, aux


def _room_plan(room: int, args):
    """Source pages, destination pages and aux rows of a room; both sides
    derive the same plan from the room id."""
    return _plan(room, args.pages, args.slots, args.pages_per_buffer, bool(args.contiguous))


@functools.lru_cache(maxsize=8192)
def _plan(room: int, pages: int, slots: int, pages_per_buffer: int, contiguous: bool):
    # Cached: the loops ask for a room's plan on every iteration.  The
    # arrays are shared, never written.
    rng = np.random.default_rng(room)
    slot = room % slots
    per_slot = pages_per_buffer // slots
    dst = slot * per_slot + rng.choice(per_slot, size=pages, replace=False)
    src = rng.choice(pages_per_buffer, size=pages, replace=False)
    if contiguous:
        dst = np.sort(dst)
        src = np.arange(pages) + rng.integers(0, pages_per_buffer - pages)
    return src.astype(np.int32), dst.astype(np.int32), slot


def _open_senders(mgrs, bootstrap, room: int, args, hold: bool = False) -> list:
    """One sender per prefill rank for room, its pages handed over in two
    chunks (chunked prefill), the aux row with the last one.  With hold, the
    senders are created and init() is called, but send() never is: the
    room stays in flight until the process dies or the decode gives up."""
    src, _, slot = _room_plan(room, args)
    group = []
    for mgr in mgrs:
        s = KVSender(mgr, bootstrap, room)
        s.init(len(src), aux_index=slot)
        if not hold:
            half = len(src) // 2
            s.send(src[:half])
            s.send(src[half:])
        group.append(s)
    return group


def _prefill_main(bootstrap, args, rooms, conn):
    mgrs = []
    data = []
    for rank in range(args.ranks):
        kv, items, aux = _buffers(rank, 1, args)
        data.append((kv, aux))
        mgrs.append(KVManager(KVArgs.from_buffers(rank, kv, items, aux, [AUX_ITEM]), "prefill",
                              bootstrap_addr=bootstrap))
    conn.send("ready")
    senders = {}
    pending = list(rooms)
    done = 0
    deadline = time.time() + args.timeout
    while (pending or senders) and time.time() < deadline:
        while pending and len(senders) < args.slots * args.ranks:
            room = pending.pop(0)
            senders[room] = _open_senders(mgrs, bootstrap, room, args)
        for room, group in list(senders.items()):
            states = [s.poll() for s in group]
            if min(states) in (KVPoll.Success, KVPoll.Failed) and all(
                    st in (KVPoll.Success, KVPoll.Failed) for st in states):
                for s in group:
                    s.clear()
                del senders[room]
                done += 1
        time.sleep(0.0002)
    conn.send(("done", done))
    conn.recv()  # wait until the decode side has finished
    for m in mgrs:
        m.close()


def run(argv=None) -> int:
    p = argparse.ArgumentParser(prog="kvrecv demo", description=__doc__)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rooms", type=int, default=200)
    p.add_argument("--pages", type=int, default=32, help="pages per room")
    p.add_argument("--buffers", type=int, default=16, help="KV buffers (layers x K/V)")
    p.add_argument("--item-len", type=int, default=4096, help="bytes per page of a buffer")
    p.add_argument("--slots", type=int, default=16, help="rooms in flight per rank")
    p.add_argument("--contiguous", action="store_true", help="contiguous page runs")
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--inject", choices=INJECTIONS, default=None,
                   help="inject a failure and show how a scheduler-style loop handles it: "
                        "failed rooms are requeued under a new room id")
    p.add_argument("--max-attempts", type=int, default=3,
                   help="with --inject: attempts per request before it is given up")
    args = p.parse_args(argv)
    args.pages_per_buffer = max(args.slots * args.pages * 2, 64)
    if args.ranks < 1 or args.rooms < 1 or args.pages < 1 or args.buffers < 1:
        p.error("--ranks, --rooms, --pages and --buffers must be >= 1")
    if args.inject:
        return _run_inject(args)

    server = BootstrapServer(port=0)
    bootstrap = server.address
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    rooms = [1000 + i for i in range(args.rooms)]
    proc = ctx.Process(target=_prefill_main, args=(bootstrap, args, rooms, child), daemon=True)
    proc.start()
    if not parent.poll(60) or parent.recv() != "ready":
        print("prefill process did not start", file=sys.stderr)
        return 1

    decode = []
    expect = []
    for rank in range(args.ranks):
        kv, items, aux = _buffers(rank, 2, args)
        for b in kv:
            b.fill(0xA5)
        decode.append((kv, aux, KVManager(KVArgs.from_buffers(rank, kv, items, aux, [AUX_ITEM]),
                                          "decode", config=KVConfig())))
        expect.append(_buffers(rank, 1, args))
    print(f"kvrecv demo: {args.ranks} prefill + {args.ranks} decode ranks, {args.rooms} rooms x "
          f"{args.pages} pages x {args.buffers} buffers, transport: {decode[0][2].transport}")

    outcomes: dict = {}
    bytes_ok = 0
    pending = list(rooms)
    active: dict = {}
    t0 = time.perf_counter()
    deadline = time.time() + args.timeout
    last_print = 0.0
    while (pending or active) and time.time() < deadline:
        busy_slots = {r % args.slots for r in active}
        for room in list(pending):
            if len(active) >= args.slots:
                break
            if room % args.slots in busy_slots:
                continue
            pending.remove(room)
            busy_slots.add(room % args.slots)
            group = []
            for rank in range(args.ranks):
                r = KVReceiver(decode[rank][2], bootstrap, room)
                r.init()
                group.append([r, False])
            active[room] = group
        for room, group in list(active.items()):
            src, dst, slot = _room_plan(room, args)
            for entry in group:
                if not entry[1] and entry[0].poll() == KVPoll.WaitingForInput:
                    entry[0].send_metadata(dst, aux_index=slot)
                    entry[1] = True
            states = [e[0].poll() for e in group]
            if not all(s in (KVPoll.Success, KVPoll.Failed) for s in states):
                continue
            state = min(states)
            if state == KVPoll.Success:
                ok = True
                for rank in range(args.ranks):
                    kv, aux, _ = decode[rank]
                    ekv, items, eaux = expect[rank]
                    for b, it in enumerate(items):
                        got = kv[b].reshape(-1, it)[dst]
                        want = ekv[b].reshape(-1, it)[src]
                        ok &= bool(np.array_equal(got, want))
                    ok &= bool(np.array_equal(aux[0].reshape(-1, AUX_ITEM)[slot],
                                              eaux[0].reshape(-1, AUX_ITEM)[slot]))
                    bytes_ok += len(src) * sum(items) + AUX_ITEM
                key = "ok" if ok else "CORRUPT"
            else:
                codes = []
                for e in group:
                    try:
                        e[0].failure_exception()
                    except Exception as exc:  # noqa: BLE001 - report any failure
                        codes.append(getattr(exc, "code", type(exc).__name__))
                key = "failed:" + ",".join(sorted(set(codes)))
            outcomes[key] = outcomes.get(key, 0) + 1
            for e in group:
                e[0].clear()
            del active[room]
        now = time.perf_counter()
        if now - last_print > 0.5:
            last_print = now
            done = sum(outcomes.values())
            bar = "#" * int(30 * done / args.rooms)
            print(f"\r[{bar:<30}] {done}/{args.rooms} rooms", end="", flush=True)
        time.sleep(0.0002)
    elapsed = time.perf_counter() - t0
    done = sum(outcomes.values())
    print(f"\r[{'#' * int(30 * done / args.rooms):<30}] {done}/{args.rooms} rooms")
    parent.send("finish")
    proc.join(30)
    if proc.is_alive():
        proc.kill()
    for _, _, m in decode:
        m.close()
    server.close()
    gbps = bytes_ok / elapsed / 1e9 if elapsed > 0 else 0.0
    print(f"moved {bytes_ok / 2**20:.1f} MiB in {elapsed:.2f} s: {gbps:.2f} GB/s")
    print("room outcomes: " + ", ".join(f"{k}={v}" for k, v in sorted(outcomes.items())))
    unfinished = args.rooms - done
    if unfinished:
        print(f"{unfinished} rooms did not finish within {args.timeout} s")
    return 0 if outcomes.get("ok", 0) == args.rooms else 1


# --------------------------------------------------------------------------
# --inject: failure handling through a scheduler-style requeue loop
# --------------------------------------------------------------------------

INJECTIONS = ("kill-prefill", "abort", "restart-prefill", "bad-layout")
# codes a scheduler gives up on at once: retrying cannot help
NOT_RETRYABLE = ("LAYOUT_MISMATCH", "PROTOCOL")
INJECT_CONFIG = dict(bootstrap_timeout_ms=3000)


def _inject_prefill_main(bootstrap, args, conn):
    """Prefill instance for --inject: the router hands it each room when it
    hands the request to the decode (requeued requests come under new room
    ids), as [(room, hold), ...]; a held room's pages are never sent."""
    mgrs = []
    data = []
    for rank in range(args.ranks):
        kv, items, aux = _buffers(rank, 1, args)
        data.append((kv, aux))
        mgrs.append(KVManager(KVArgs.from_buffers(rank, kv, items, aux, [AUX_ITEM]), "prefill",
                              bootstrap_addr=bootstrap, config=KVConfig(**INJECT_CONFIG)))
    conn.send("ready")
    senders = {}
    while True:
        while conn.poll(0):
            msg = conn.recv()
            if msg == "finish":
                for group in senders.values():
                    for s in group:
                        s.clear()
                for m in mgrs:
                    m.close()
                return
            for room, hold in msg:
                senders[room] = _open_senders(mgrs, bootstrap, room, args, hold)
        for room, group in list(senders.items()):
            states = [s.poll() for s in group]
            if all(st in (KVPoll.Success, KVPoll.Failed) for st in states):
                for s in group:
                    s.clear()
                del senders[room]
        time.sleep(0.0005)


def _start_prefill(ctx, server, args):
    """Starts a prefill instance (one process, all ranks) and returns once
    every rank of it is registered with the bootstrap server."""
    regs = server.stats()["registrations"]
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_inject_prefill_main, args=(server.address, args, child),
                       daemon=True)
    proc.start()
    if not parent.poll(60) or parent.recv() != "ready":
        raise RuntimeError("prefill process did not start")
    deadline = time.time() + 30
    while server.stats()["registrations"] < regs + args.ranks:
        if time.time() > deadline:
            raise RuntimeError("the prefill process did not register with the bootstrap server")
        time.sleep(0.005)
    return proc, parent


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def _verify(decode, expect, args, room) -> bool:
    src, dst, slot = _room_plan(room, args)
    ok = True
    for rank in range(args.ranks):
        kv, aux, _ = decode[rank]
        ekv, items, eaux = expect[rank]
        for b, it in enumerate(items):
            ok &= bool(np.array_equal(kv[b].reshape(-1, it)[dst], ekv[b].reshape(-1, it)[src]))
        ok &= bool(np.array_equal(aux[0].reshape(-1, AUX_ITEM)[slot],
                                  eaux[0].reshape(-1, AUX_ITEM)[slot]))
    return ok


def _run_inject(args) -> int:
    """The scheduler-style loop.  Requests are admitted (a receiver per
    decode rank, and the room handed to the prefill) while a slot is free;
    a failed request is requeued under a new room id, up to --max-attempts.

    kill-prefill and restart-prefill inject at a point where rooms are really
    in flight: the prefill holds back the pages of the first attempt of every
    fifth request of the first wave (the first --slots requests), and the
    requests after the first wave wait until the injection.  Once only the
    held rooms are left in flight:

    - kill-prefill: the prefill process is killed.  The decode fails the held
      rooms with PEER_LOST; no request is admitted while no prefill is up;
      once every held room has failed, a replacement prefill process starts
      (as an orchestrator would restart it) and the requeued requests go to
      it.
    - restart-prefill: a new prefill instance starts and registers with the
      bootstrap server while the old one, alive, still holds the rooms.  The
      next request the decode admits makes it re-check the registration:
      the held rooms fail with PEER_RESTARTED and every room from then on
      goes to the new instance.  The old process is then killed.  (With no
      request left to admit, nothing would notice the new instance; the old
      process is then killed at once and the rooms fail with PEER_LOST.)
    """
    from ._core import KVTransferError

    server = BootstrapServer(port=0)
    bootstrap = server.address
    ctx = mp.get_context("spawn")
    try:
        proc, pipe = _start_prefill(ctx, server, args)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        server.close()
        return 1
    decode, expect = [], []
    for rank in range(args.ranks):
        kv, items, aux = _buffers(rank, 2, args)
        if args.inject == "bad-layout" and rank == args.ranks - 1:
            items = list(items)
            items[0] *= 2  # this rank registers another item_len for buffer 0
        for b in kv:
            b.fill(0xA5)
        decode.append((kv, aux, KVManager(KVArgs.from_buffers(rank, kv, items, aux, [AUX_ITEM]),
                                          "decode", config=KVConfig(**INJECT_CONFIG))))
        expect.append(_buffers(rank, 1, args))
    mgrs = [d[2] for d in decode]
    for m in mgrs:
        m.set_siblings([x.endpoint for x in mgrs])
    print(f"kvrecv demo --inject {args.inject}: {args.ranks} prefill + {args.ranks} decode ranks, "
          f"{args.rooms} requests, transport: {mgrs[0].transport}")

    # request id -> current room; requeued requests get a new room id
    room_of = {rid: 1000 + rid for rid in range(args.rooms)}
    attempts = {rid: 1 for rid in range(args.rooms)}
    next_room = [1000 + args.rooms + 100000]
    pending = list(range(args.rooms))
    active: dict = {}
    result: dict = {}  # rid -> "ok" / "CORRUPT" / code
    attempt_failures: dict = {}
    requeued = 0
    deadline = time.time() + args.timeout
    victims = {rid for rid in range(args.rooms) if rid % 5 == 2}
    process_fault = args.inject in ("kill-prefill", "restart-prefill")
    first_wave = min(args.rooms, args.slots)
    if process_fault:
        victims = {rid for rid in victims if rid < first_wave}
    # phases of a process fault: "hold" (first wave only) -> "down" (kill:
    # no prefill up) or "replaced" (restart: the old one still runs until
    # its rooms failed) -> "done"
    phase = "hold" if process_fault else "done"
    old_proc = None

    def requeue(rid, code):
        nonlocal requeued
        attempt_failures[code] = attempt_failures.get(code, 0) + 1
        if code in NOT_RETRYABLE or attempts[rid] >= args.max_attempts:
            result[rid] = code
            return
        attempts[rid] += 1
        requeued += 1
        room_of[rid] = next_room[0]
        next_room[0] += 1
        pending.append(rid)

    def start_prefill():
        try:
            return _start_prefill(ctx, server, args)
        except RuntimeError as e:
            print(e, file=sys.stderr)
            return None, None

    while (pending or active) and time.time() < deadline:
        if phase == "hold" and set(active) == victims and all(active[r][1] for r in victims) \
                and len(result) + len(victims) >= first_wave:
            # only the held rooms are in flight: inject
            if args.inject == "kill-prefill":
                proc.kill()
                proc.join(10)
                phase = "down"
                print(f"injected: prefill process killed with {_n(len(active), 'request')} in flight")
            else:
                old_proc, old_pipe = proc, pipe
                proc, pipe = start_prefill()
                if proc is None:
                    break
                print(f"injected: a new prefill instance registered, with "
                      f"{_n(len(active), 'request')} in flight on the old one")
                phase = "replaced"
                if not pending:
                    old_proc.kill()
                    old_proc.join(10)
                    old_proc = None
                    phase = "done"
                    print("injected: no request left to admit; old prefill process killed")
        elif phase == "down" and not active:
            proc, pipe = start_prefill()
            if proc is None:
                break
            print("injected: replacement prefill process started")
            phase = "done"
        elif phase == "replaced" and not any(r in victims and attempts[r] == 1 for r in active):
            old_proc.kill()
            old_proc.join(10)
            old_proc = None
            print("injected: old prefill process killed")
            phase = "done"

        busy = {room_of[r] % args.slots for r in active}
        handed = []
        for rid in list(pending):
            if len(active) >= args.slots or phase == "down":
                break
            if phase == "hold" and rid >= first_wave:
                break
            if room_of[rid] % args.slots in busy:
                continue
            pending.remove(rid)
            busy.add(room_of[rid] % args.slots)
            group = []
            for rank in range(args.ranks):
                r = KVReceiver(mgrs[rank], bootstrap, room_of[rid])
                r.init()
                group.append(r)
            active[rid] = [group, False]
            handed.append((room_of[rid], process_fault and rid in victims and attempts[rid] == 1))
        if handed:
            pipe.send(handed)  # the router hands the request to the prefill too
        for rid, entry in list(active.items()):
            group, sent = entry
            room = room_of[rid]
            state = min(r.poll() for r in group)  # the scheduler's MIN all-reduce
            if not sent and state == KVPoll.WaitingForInput:
                if args.inject == "abort" and rid in victims and attempts[rid] == 1:
                    group[0].abort()  # an AbortReq reaches decode rank 0
                else:
                    _, dst, slot = _room_plan(room, args)
                    for r in group:
                        r.send_metadata(dst, aux_index=slot)
                    entry[1] = True
                continue
            if state == KVPoll.Success:
                result[rid] = "ok" if _verify(decode, expect, args, room) else "CORRUPT"
            elif state == KVPoll.Failed:
                code = None
                for r in group:
                    try:
                        r.failure_exception()
                    except KVTransferError as e:
                        if code is None or not e.is_from_another_rank:
                            code = e.code or "UNKNOWN"
                requeue(rid, code)
            else:
                continue
            for r in group:
                r.clear()
            del active[rid]
        time.sleep(0.0005)

    if old_proc is not None:
        old_proc.kill()
        old_proc.join(10)
    if proc is not None and proc.is_alive():
        pipe.send("finish")
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    for m in mgrs:
        m.close()
    server.close()
    ok = sum(1 for v in result.values() if v == "ok")
    failed: dict = {}
    for v in result.values():
        if v != "ok":
            failed[v] = failed.get(v, 0) + 1
    unfinished = args.rooms - len(result)
    print(f"requests: ok={ok} failed={sum(failed.values())}"
          + (" (" + ", ".join(f"{k}={v}" for k, v in sorted(failed.items())) + ")" if failed else "")
          + (f" unfinished={unfinished}" if unfinished else ""))
    print("failed attempts by code: "
          + (", ".join(f"{k}={v}" for k, v in sorted(attempt_failures.items())) or "none"))
    print(f"requeued under a new room id: {requeued}")
    return 0 if ok == args.rooms else 1
