/*
 * ucxlog: UCX's own log lines, into the kvrecv log.
 *
 * UCX prints its warnings and errors to stderr through a process-wide list
 * of handlers.  kvr_ucxlog_install() puts a handler in front of UCX's that
 * hands each line to the newest open kvrecv log (kvr_log_write_shared) at
 * the matching level, so that it reaches Python's "kvrecv" logger and not
 * stderr.  With no kvrecv log open, and for FATAL lines (the process is
 * about to abort), UCX's own handler prints the line too.  Also says, once
 * a manager has an endpoint, which transports UCX chose.
 */
#ifndef KVR_UCXLOG_H
#define KVR_UCXLOG_H

/* Installs the handler once per process; any thread, any number of times. */
void kvr_ucxlog_install(void);

/*
 * On this thread, between kvr_ucxlog_expect_refusal(1) and (0), UCX's
 * ERROR lines are logged at DEBUG: the caller asks UCX for something it
 * may refuse (peer-failure handling over shared memory) and handles the
 * refusal itself, so the line is no error of the user's.
 */
void kvr_ucxlog_expect_refusal(int on);

/*
 * On this thread, between kvr_ucxlog_expect_unreturned(1) and (0), UCX's
 * "object ... was not returned to mpool" warnings are logged at DEBUG: the
 * caller destroys the worker of a peer that died with UCX requests in
 * flight that nothing can complete or cancel (UCX 1.13 cancels no active
 * message receive), and the pools go with the worker, memory and all.
 */
void kvr_ucxlog_expect_unreturned(int on);

/*
 * Logs at INFO which transports UCX chose for the endpoint ep (a ucp_ep_h)
 * and, from peer_errors (it was created with UCX's peer-failure handling),
 * how a dead peer is noticed.  The caller says it once per kind.
 */
void kvr_ucxlog_say_endpoint(void *ep, int peer_errors);

/* 1 if every lane of UCX endpoint ep (a ucp_ep_h) goes over tcp. */
int kvr_ucxlog_ep_tcp_only(void *ep);

#endif
