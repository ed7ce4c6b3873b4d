/*
 * auth.c - keys and the control channel's mutual challenge-response.
 *
 * Every link (pair of nodes) has its own key, configured on both ends in
 * the peer's entry ("key", "keys" or "key_file"); up to two keys are held
 * per link so a key can be rolled without downtime.  Nothing secret crosses
 * the wire: the listener sends a fresh 32-byte nonce, the connecting side
 * answers with its own nonce and HMAC-SHA-256 over the transcript, and the
 * listener proves the same key back.  The transcript binds the protocol
 * version, a direction label, both node ids and roles (as each side's
 * configuration says), both nonces and the key id, so a recorded handshake,
 * a proof reflected back at its author, or one node's key used under
 * another node's id never verifies.
 */

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include "kv.h"

#define KV_AUTH_TAG  "kv_agent-auth-2"


int
kv_auth_nonce(uint8_t *out, size_t n)
{
    return RAND_bytes(out, (int) n) == 1 ? 0 : -1;
}


static int
hmac(const uint8_t *key, size_t klen, const uint8_t *msg, size_t mlen,
    uint8_t out[KV_MAC_LEN])
{
    unsigned int olen = KV_MAC_LEN;

    if (HMAC(EVP_sha256(), key, (int) klen, msg, mlen, out, &olen) == NULL
        || olen != KV_MAC_LEN)
    {
        return -1;
    }
    return 0;
}


/* Key id: the first 8 bytes of HMAC(key, "kv_agent key id"), in hex.  It
 * names a key in logs and in the hello without revealing it. */
int
kv_auth_key_id(const uint8_t *key, size_t klen, char out[KV_KID_LEN])
{
    static const char label[] = "kv_agent key id";
    uint8_t mac[KV_MAC_LEN];

    if (hmac(key, klen, (const uint8_t *) label, sizeof(label) - 1, mac)) {
        return -1;
    }
    kv_hex_encode(mac, 8, out);
    return 0;
}


static size_t
put(uint8_t *buf, size_t off, size_t cap, const void *p, size_t n)
{
    /* each field is length-prefixed: no two transcripts share bytes */
    if (off + 2 + n > cap) {
        return cap + 1;
    }
    buf[off] = (uint8_t) (n >> 8);
    buf[off + 1] = (uint8_t) n;
    memcpy(buf + off + 2, p, n);
    return off + 2 + n;
}


/*
 * proof = HMAC-SHA-256(key, tag | dir | client id | client role |
 *                      server id | server role | client nonce |
 *                      server nonce | key id)
 * dir is KV_AUTH_CLIENT for the connecting side's proof and KV_AUTH_SERVER
 * for the listener's.
 */
int
kv_auth_proof(const uint8_t *key, size_t klen, int dir,
    const char *client_id, uint32_t client_role, const char *server_id,
    uint32_t server_role, const uint8_t nc[KV_NONCE_LEN],
    const uint8_t ns[KV_NONCE_LEN], const char *kid, uint8_t out[KV_MAC_LEN])
{
    uint8_t buf[512];
    const char *d = dir == KV_AUTH_CLIENT ? "client->server"
                                          : "server->client";
    const char *cr = dpd_state_role_name(client_role);
    const char *sr = dpd_state_role_name(server_role);
    size_t off = 0, cap = sizeof(buf);

    off = put(buf, off, cap, KV_AUTH_TAG, strlen(KV_AUTH_TAG));
    if (off <= cap) off = put(buf, off, cap, d, strlen(d));
    if (off <= cap) off = put(buf, off, cap, client_id, strlen(client_id));
    if (off <= cap) off = put(buf, off, cap, cr, strlen(cr));
    if (off <= cap) off = put(buf, off, cap, server_id, strlen(server_id));
    if (off <= cap) off = put(buf, off, cap, sr, strlen(sr));
    if (off <= cap) off = put(buf, off, cap, nc, KV_NONCE_LEN);
    if (off <= cap) off = put(buf, off, cap, ns, KV_NONCE_LEN);
    if (off <= cap) off = put(buf, off, cap, kid, strlen(kid));
    if (off > cap) {
        return -1;
    }
    return hmac(key, klen, buf, off, out);
}


int
kv_auth_equal(const uint8_t *a, const uint8_t *b, size_t n)
{
    return CRYPTO_memcmp(a, b, n) == 0;
}


/* One key: hex, KV_KEY_MIN..KV_KEY_MAX bytes. */
static int
key_add(kv_peer_conf_t *p, const char *hex, size_t hlen, const char *where,
    char *err, size_t elen)
{
    char tmp[2 * KV_KEY_MAX + 1];
    size_t n;
    int k;

    if (p->nkeys == KV_MAX_KEYS) {
        snprintf(err, elen, "peer %s: at most %d keys (the current one and "
                 "the next, while rolling)", p->id, KV_MAX_KEYS);
        return -1;
    }
    if (hlen >= sizeof(tmp) || hlen < 2 * KV_KEY_MIN) {
        snprintf(err, elen, "peer %s: %s: a key is %d to %d bytes written "
                 "as hex (make one with: openssl rand -hex 32)", p->id,
                 where, KV_KEY_MIN, KV_KEY_MAX);
        return -1;
    }
    memcpy(tmp, hex, hlen);
    tmp[hlen] = '\0';
    k = p->nkeys;
    if (kv_hex_decode(tmp, p->key[k], KV_KEY_MAX, &n) != 0
        || n < KV_KEY_MIN)
    {
        OPENSSL_cleanse(tmp, sizeof(tmp));
        snprintf(err, elen, "peer %s: %s: a key is %d to %d bytes written "
                 "as hex (make one with: openssl rand -hex 32)", p->id,
                 where, KV_KEY_MIN, KV_KEY_MAX);
        return -1;
    }
    OPENSSL_cleanse(tmp, sizeof(tmp));
    p->keylen[k] = n;
    if (kv_auth_key_id(p->key[k], n, p->kid[k]) != 0) {
        snprintf(err, elen, "peer %s: cannot derive a key id", p->id);
        return -1;
    }
    if (k > 0 && strcmp(p->kid[0], p->kid[k]) == 0) {
        snprintf(err, elen, "peer %s: the same key is given twice", p->id);
        return -1;
    }
    p->nkeys++;
    return 0;
}


int
kv_auth_key_hex(kv_peer_conf_t *p, const char *hex, const char *where,
    char *err, size_t elen)
{
    return key_add(p, hex, strlen(hex), where, err, elen);
}


/*
 * A key file: one or two hex keys, one per line (the first is the one this
 * node proves with; '#' starts a comment).  It must be a regular file that
 * others cannot read or write.
 */
int
kv_auth_key_file(kv_peer_conf_t *p, const char *path, char *err,
    size_t elen)
{
    char buf[1024], *s, *e, *nl;
    struct stat sb;
    ssize_t n;
    int fd, rc = 0;

    /* symlinks are followed (Kubernetes secret volumes are made of them);
     * the checks below are on the file itself */
    fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) {
        snprintf(err, elen, "peer %s: key_file %s: %s", p->id, path,
                 strerror(errno));
        return -1;
    }
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        close(fd);
        snprintf(err, elen, "peer %s: key_file %s is not a regular file",
                 p->id, path);
        return -1;
    }
    if (sb.st_mode & (S_IROTH | S_IWOTH | S_IWGRP)) {
        close(fd);
        snprintf(err, elen, "peer %s: key_file %s is mode %04o: others may "
                 "read or change it (chmod 600 or 640)", p->id, path,
                 (unsigned) (sb.st_mode & 07777));
        return -1;
    }
    n = read(fd, buf, sizeof(buf) - 1);
    close(fd);
    if (n < 0 || (size_t) n >= sizeof(buf) - 1) {
        OPENSSL_cleanse(buf, sizeof(buf));
        snprintf(err, elen, "peer %s: key_file %s: %s", p->id, path,
                 n < 0 ? strerror(errno) : "larger than 1 KiB");
        return -1;
    }
    buf[n] = '\0';
    for (s = buf; rc == 0 && *s; s = nl) {
        nl = strchr(s, '\n');
        nl = nl ? nl + 1 : s + strlen(s);
        e = memchr(s, '#', (size_t) (nl - s));
        if (e == NULL) {
            e = nl;
        }
        while (s < e && (*s == ' ' || *s == '\t' || *s == '\r')) s++;
        while (e > s && (e[-1] == ' ' || e[-1] == '\t' || e[-1] == '\r'
                         || e[-1] == '\n'))
        {
            e--;
        }
        if (e > s) {
            rc = key_add(p, s, (size_t) (e - s), path, err, elen);
        }
    }
    OPENSSL_cleanse(buf, sizeof(buf));
    if (rc == 0 && p->nkeys == 0) {
        snprintf(err, elen, "peer %s: key_file %s holds no key", p->id, path);
        return -1;
    }
    return rc;
}


void
kv_auth_forget(kv_config_t *c)
{
    OPENSSL_cleanse(c->peers, sizeof(c->peers));
}


void
kv_auth_forget_peer(kv_peer_conf_t *p)
{
    OPENSSL_cleanse(p->key, sizeof(p->key));
}
