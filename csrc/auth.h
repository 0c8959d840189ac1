/*
 * auth: authentication of control messages with a shared secret.
 *
 * With a secret configured, every control message is sealed before it is
 * sent: the header's type field gets KVR_AUTH_FLAG and the message gets a
 * 40-byte trailer,
 *
 *     [ message (header + body) ][ seq: u64 LE ][ HMAC-SHA256: 32 bytes ]
 *
 * where the HMAC (keyed with the secret) covers everything before it,
 * flagged header and seq included.  seq counts the messages the sender has
 * sealed since it started (from 1), so (header epoch, seq) never repeats for
 * one sender instance.
 *
 * The receiver verifies the tag in constant time before anything decodes
 * the message, then checks freshness: per sender epoch it keeps the highest
 * seq seen and a 64-message window below it (messages of one sender may
 * reach one receiver over two connections, slightly out of order), and
 * refuses a seq it has already seen or one older than the window.  It also
 * refuses messages that carry its own epoch (reflected back at it).
 *
 * Not thread safe: one kvr_auth_t belongs to the thread that owns the
 * sockets (the engine thread, or the bootstrap server's thread).
 */
#ifndef KVR_AUTH_H
#define KVR_AUTH_H

#include <stddef.h>
#include <stdint.h>

#define KVR_AUTH_FLAG 0x8000u   /* in the header's type field: sealed */
#define KVR_AUTH_MAC_LEN 32
#define KVR_AUTH_TRAILER_LEN 40 /* seq + MAC */
#define KVR_AUTH_SECRET_MAX 256
#define KVR_AUTH_WINDOW 64
/* Sender epochs whose freshness state is kept; beyond, the least recently
 * heard one is forgotten. */
#define KVR_AUTH_MAX_SENDERS 4096

typedef struct kvr_auth kvr_auth_t;

/* Result of kvr_auth_open. */
enum {
    KVR_AUTH_OK = 0,
    KVR_AUTH_UNSEALED = 1, /* no flag / too short: the sender has no secret */
    KVR_AUTH_BAD_TAG = 2,  /* the tag does not verify: another secret, or forged */
    KVR_AUTH_REPLAY = 3,   /* verified, but already seen, too old or reflected */
};

/* Returns 0, or -1 if memory ran out or the secret is empty or too long. */
int kvr_auth_create(const void *secret, size_t len, uint64_t self_epoch, kvr_auth_t **a_p);
void kvr_auth_destroy(kvr_auth_t *a);

/*
 * Seals msg (len >= 16 bytes, an encoded message) into out, which must hold
 * len + KVR_AUTH_TRAILER_LEN bytes.  Returns 0, or -1 if len is too short or
 * the library failed.
 */
int kvr_auth_seal(kvr_auth_t *a, const void *msg, size_t len, unsigned char *out);

/*
 * Verifies a received message in place.  On KVR_AUTH_OK, *body_len is the
 * length of the message without its trailer and the flag is cleared, so
 * that buf[0..*body_len) decodes as an ordinary message.  Otherwise returns
 * KVR_AUTH_* with *why naming the check that failed.  The tag is checked
 * before anything else of the message is interpreted.
 */
int kvr_auth_open(kvr_auth_t *a, unsigned char *buf, size_t len, size_t *body_len,
                  const char **why);

/* 1 if buf looks sealed (a header whose type carries KVR_AUTH_FLAG). */
int kvr_auth_is_sealed(const void *buf, size_t len);

/* Message type of a header (flag removed), or -1 if buf is no header. */
int kvr_auth_peek_type(const void *buf, size_t len);

#endif
