/*
 * ucxtune: the UCX settings kvrecv changes from UCX's defaults, in one
 * table (ucxtune.c, with the measurements behind each), applied to a UCX
 * configuration where UCX_TLS lets UCX use their transports and no
 * variable of the environment sets them.
 *
 * Thread: any; touches only its arguments (and reads the environment).
 */
#ifndef KVR_UCXTUNE_H
#define KVR_UCXTUNE_H

#include <stddef.h>

enum {
    KVR_TUNE_TCP_TX_SEG,
    KVR_TUNE_TCP_RX_SEG,
    KVR_TUNE_TCP_ZCOPY,
    KVR_TUNE_MM_SEG,
    KVR_TUNE_MM_FIFO,
    KVR_TUNE_N
};

/*
 * Applies the table to config (a ucp_config_t *, before ucp_init) for
 * UCX_TLS tls (NULL: unset).  Writes what it set into tuned ("" if
 * nothing, else "UCX_X=v UCX_Y=w") and the values in effect, set by it or
 * by the environment, into values[KVR_TUNE_N]: 0 where not known or where
 * UCX_TLS leaves the transports out, except the tcp receive size, which is
 * then SIZE_MAX (nothing arrives over tcp).  values must start zeroed.
 */
void kvr_ucxtune_apply(void *config, const char *tls, char *tuned, size_t tuned_len,
                       size_t *values);

#endif
