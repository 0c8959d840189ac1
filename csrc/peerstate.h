/*
 * peerstate: which state changes of a peer are legal, pure logic.  The
 * diagram is peer.c's; the engine changes a peer's state only through
 * kvr_peer_set_state (engine_int.h), which checks it here in debug builds.
 *
 *   decode's view of a prefill (KVR_PEER_IS_PREFILL)
 *     (new), FAILED -> RESOLVING -> CONNECTING -> READY
 *     READY -> RESOLVING   (the bootstrap server names a restarted instance)
 *   prefill's view of a decode (KVR_PEER_IS_DECODE)
 *     (new), FAILED, READY -> READY    (its HELLO, again after a failure)
 *   both
 *     any -> FAILED; any -> itself (a repeated event)
 *
 * A new peer starts RESOLVING (zeroed); a decode's view of a prefill that
 * the engine thread is to resolve starts FAILED.  Any thread.
 */
#ifndef KVR_PEERSTATE_H
#define KVR_PEERSTATE_H

enum { KVR_PEER_RESOLVING, KVR_PEER_CONNECTING, KVR_PEER_READY, KVR_PEER_FAILED };
enum { KVR_PEER_IS_PREFILL, KVR_PEER_IS_DECODE };

/* 1 if a peer of this kind may go from state `from` to state `to`. */
int kvr_peer_state_legal(int kind, int from, int to);

#endif
