/*
 * kv_events_sub.c - the router's subscriber to vLLM's KV-event publishers.
 *
 * Each configured source ("kv_events" in the config) is one engine's
 * ZmqEventPublisher (vllm/distributed/kv_events.py
 * @0181ea3173e53eea8cf04a86891488e3dc89bb34): a PUB sending three
 * frames (topic, seq as 8 bytes big-endian counting from 0 per process,
 * msgpack payload) and, optionally, a ROUTER replaying its last
 * buffer_steps payloads.  We connect to both (no listening port here).
 *
 * Sequence numbers, per source:
 *   seq == last + 1      in order: decoded, delivered to the sink;
 *   seq >  last + 1      a gap (PUB drops past its high-water mark, or a
 *                        reconnect): replayed from last + 1 when the
 *                        source has a replay endpoint, else the node's
 *                        entries are cleared (KV_EV_CLEAR_GAP) and the
 *                        stream taken up at seq;
 *   seq <= last          the publisher restarted (vLLM restarts at 0):
 *                        cleared (KV_EV_CLEAR_RESTART), then as a first
 *                        message;
 *   after the connection dropped (a socket monitor tells), a seq other
 *                        than last + 1 is cleared (KV_EV_CLEAR_RECONNECT)
 *                        and taken as a first message: an engine that
 *                        restarted and published past our last seq
 *                        looks exactly like a loss;
 *   first message        taken as is when seq is 0 or there is no replay;
 *                        else the publisher's buffer is replayed from 0
 *                        first, so a late subscriber learns what the
 *                        engine cached before it came.
 * Replay: a DEALER sends ["", start_seq (8 bytes)]; the ROUTER answers
 * ["", seq, payload] per buffered batch (vLLM; ["", topic, seq, payload]
 * from publishers that add the topic, as TensorRT-LLM's vLLM-compatible
 * one does), then seq = eight 0xFF bytes.  A replay that goes quiet for
 * replay_timeout_ms (or runs over 10x that in all) is abandoned: the
 * DEALER is closed (late replies can never be mistaken for a new
 * replay's), the node cleared, the stream taken up live.  While a source
 * replays, its live messages wait in its SUB queue.
 *
 * Never blocking: every receive is ZMQ_DONTWAIT, and a call handles at
 * most KV_EVS_BATCH messages per source (the loop calls again within its
 * 20 ms timer, so the ZMQ fd's edge semantics cannot strand messages).
 * Frames are bounded (ZMQ_MAXMSGSIZE): a larger message closes that
 * connection; we connect again (libzmq would not, after that protocol
 * error) and the loss is handled as after any dropped connection.
 */

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <zmq.h>

#include "kv.h"
#include "kv_events.h"


#define KV_EVS_BATCH        1024       /* messages per source per call */
#define KV_EVS_RCVHWM       10000
#define KV_EVS_FRAMES       8          /* frames read of one message */
#define KV_EVS_END_SEQ      UINT64_MAX /* eight 0xFF bytes */
#define KV_EVS_HB_IVL       2000       /* ms between ZMTP pings */
#define KV_EVS_HB_TIMEOUT   6000       /* ms without traffic: dropped */


typedef struct {
    const kv_evs_src_conf_t *c;        /* &own */
    kv_evs_src_conf_t own;
    int             used;
    uint32_t        idx;
    void           *sub, *dealer;
    void           *mon;               /* the SUB's connection events */
    int             lost;              /* disconnected since last message */
    int             have_seq;
    uint64_t        last;
    int             replaying;
    uint64_t        t_start, t_last;   /* replay: began, last reply */
    uint8_t        *held;              /* the live message that started */
    size_t          held_len;          /* the replay, taken up after it */
    uint64_t        held_seq;
    int             have_held;
    kv_evs_src_stats_t st;
    uint64_t        t_warn;
    uint64_t        t_clear;           /* the last clear line */
    uint64_t        clear_quiet;       /* clears not logged since */
} evs_src_t;

struct kv_evs {
    void             *zctx;
    evs_src_t        *src;             /* KV_EVS_MAX_SOURCES slots */
    int               nsrc;            /* slots [0, nsrc) may be used */
    uint64_t          gen;             /* names monitor endpoints */
    kv_ev_decoder_t   dec;
    kv_ev_sink_t      sink;
};


static void
evs_origin(evs_src_t *s, uint64_t seq, kv_ev_origin_t *o)
{
    memset(o, 0, sizeof(*o));
    o->node = s->c->node;
    o->http = s->c->http;
    o->idx = s->idx;
    o->seq = seq;
    o->dp_rank = -1;
}


static void
evs_clear(struct kv_evs *e, evs_src_t *s, uint64_t seq, kv_ev_clear_t why)
{
    kv_ev_origin_t o;
    uint64_t now;

    evs_origin(s, seq, &o);
    s->st.clears++;
    /* one line a second per source, as "message dropped": a publisher
     * that restarts in a loop must not flood the log; the lines left out
     * are counted in the next one */
    now = kv_now_ms();
    if (s->t_clear != 0 && now - s->t_clear < 1000) {
        s->clear_quiet++;
    } else {
        s->t_clear = now;
        kv_info("kv_events: %s: %s at seq %llu: its entries are dropped "
                "(%llu clears not logged in the last second, %llu in "
                "all)", s->c->node, why == KV_EV_CLEAR_RESTART
                ? "publisher restarted" : why == KV_EV_CLEAR_RECONNECT
                ? "reconnected elsewhere in the stream" : "messages lost",
                (unsigned long long) seq,
                (unsigned long long) s->clear_quiet,
                (unsigned long long) s->st.clears);
        s->clear_quiet = 0;
    }
    if (e->sink.cleared) {
        e->sink.cleared(e->sink.data, &o, why);
    }
}


static void
evs_deliver(struct kv_evs *e, evs_src_t *s, uint64_t seq, const uint8_t *p,
    size_t n)
{
    kv_ev_origin_t o;
    uint64_t refused = e->dec.st.refused, now;

    evs_origin(s, seq, &o);
    s->have_seq = 1;
    s->last = seq;
    s->st.msgs++;
    if (kv_ev_decode(&e->dec, p, n, &o, &e->sink) < 0) {
        s->st.refused_msgs++;
    } else if (e->dec.st.refused == refused) {
        return;
    }
    now = kv_now_ms();
    if (now - s->t_warn >= 1000) {     /* one line a second */
        s->t_warn = now;
        kv_warn("kv_events: %s: seq %llu: %s (refused so far: %llu "
                "messages, %llu events)", s->c->node,
                (unsigned long long) seq,
                e->dec.why ? e->dec.why : "malformed",
                (unsigned long long) s->st.refused_msgs,
                (unsigned long long) e->dec.st.refused);
    }
}


static void
evs_hold_free(evs_src_t *s)
{
    free(s->held);
    s->held = NULL;
    s->have_held = 0;
}


static int
evs_replay_start(struct kv_evs *e, evs_src_t *s, uint64_t from,
    uint64_t seq, const uint8_t *p, size_t n)
{
    uint8_t be[8];
    int v, k;

    /* the message that showed the gap, taken up after the replay; kept
     * before anything is asked, so a request is never left unread */
    s->held = malloc(n ? n : 1);
    if (s->held == NULL) {
        return -1;
    }
    memcpy(s->held, p, n);
    s->held_len = n;
    s->held_seq = seq;
    s->have_held = 1;
    if (s->dealer == NULL) {
        s->dealer = zmq_socket(e->zctx, ZMQ_DEALER);
        if (s->dealer == NULL) {
            evs_hold_free(s);
            return -1;
        }
        v = 0;
        zmq_setsockopt(s->dealer, ZMQ_LINGER, &v, sizeof(v));
        {
            int64_t max = (int64_t) e->dec.lim.max_payload + 4096;
            zmq_setsockopt(s->dealer, ZMQ_MAXMSGSIZE, &max, sizeof(max));
        }
        v = 1;
        if (strchr(s->c->replay, '[')) {
            zmq_setsockopt(s->dealer, ZMQ_IPV6, &v, sizeof(v));
        }
        if (zmq_connect(s->dealer, s->c->replay) != 0) {
            kv_warn("kv_events: %s: replay %s: %s", s->c->node,
                    s->c->replay, zmq_strerror(errno));
            zmq_close(s->dealer);
            s->dealer = NULL;
            evs_hold_free(s);
            return -1;
        }
    }
    for (k = 0; k < 8; k++) {
        be[k] = (uint8_t) (from >> (56 - 8 * k));
    }
    if (zmq_send(s->dealer, "", 0, ZMQ_SNDMORE | ZMQ_DONTWAIT) != 0
        || zmq_send(s->dealer, be, 8, ZMQ_DONTWAIT) != 8)
    {
        kv_warn("kv_events: %s: replay request not sent: %s", s->c->node,
                zmq_strerror(errno));
        zmq_close(s->dealer);
        s->dealer = NULL;
        evs_hold_free(s);
        return -1;
    }
    s->replaying = 1;
    s->t_start = s->t_last = kv_now_ms();
    s->st.replays++;
    kv_info("kv_events: %s: replaying from seq %llu (%s)", s->c->node,
            (unsigned long long) from, s->c->replay);
    return 0;
}


/* a replayed or held message, in order */
static void
evs_in_order(struct kv_evs *e, evs_src_t *s, uint64_t seq, const uint8_t *p,
    size_t n)
{
    if (s->have_seq && seq <= s->last) {
        s->st.dups++;                  /* had it already */
        return;
    }
    if (s->have_seq && seq != s->last + 1) {
        s->st.gaps++;                  /* the buffer no longer has them */
        evs_clear(e, s, seq, KV_EV_CLEAR_GAP);
    }
    evs_deliver(e, s, seq, p, n);
}


static void
evs_replay_end(struct kv_evs *e, evs_src_t *s, int ok)
{
    s->replaying = 0;
    if (ok) {
        s->st.replays_ok++;
    } else {
        s->st.replays_failed++;
        kv_warn("kv_events: %s: replay from %s abandoned (no answer in "
                "%d ms)", s->c->node, s->c->replay,
                s->c->replay_timeout_ms);
        zmq_close(s->dealer);          /* its late replies die with it */
        s->dealer = NULL;
    }
    if (s->have_held) {
        evs_in_order(e, s, s->held_seq, s->held, s->held_len);
        evs_hold_free(s);
    }
}


/* a live message from the SUB socket */
static void
evs_live(struct kv_evs *e, evs_src_t *s, uint64_t seq, const uint8_t *p,
    size_t n)
{
    if (s->lost) {
        s->lost = 0;
        if (s->have_seq && seq > s->last + 1) {
            s->st.reconnects++;
            evs_clear(e, s, seq, KV_EV_CLEAR_RECONNECT);
            s->have_seq = 0;
        }
    }
    if (s->have_seq && seq <= s->last) {
        s->st.restarts++;
        evs_clear(e, s, seq, KV_EV_CLEAR_RESTART);
        s->have_seq = 0;
    }
    if (!s->have_seq) {
        if (seq != 0 && s->c->replay[0]
            && evs_replay_start(e, s, 0, seq, p, n) == 0)
        {
            return;
        }
        evs_deliver(e, s, seq, p, n);
        return;
    }
    if (seq == s->last + 1) {
        evs_deliver(e, s, seq, p, n);
        return;
    }
    s->st.gaps++;
    if (s->c->replay[0]
        && evs_replay_start(e, s, s->last + 1, seq, p, n) == 0)
    {
        return;
    }
    evs_clear(e, s, seq, KV_EV_CLEAR_GAP);
    evs_deliver(e, s, seq, p, n);
}


/* One multipart message: up to KV_EVS_FRAMES frames kept, the rest
 * dropped (*nf is then KV_EVS_FRAMES + 1).  0, or -1 when none. */
static int
evs_recv(void *sock, zmq_msg_t *f, int *nf)
{
    zmq_msg_t extra;
    int more = 1;

    *nf = 0;
    zmq_msg_init(&f[0]);
    if (zmq_msg_recv(&f[0], sock, ZMQ_DONTWAIT) < 0) {
        zmq_msg_close(&f[0]);
        return -1;
    }
    *nf = 1;
    more = zmq_msg_more(&f[0]);
    while (more) {
        if (*nf < KV_EVS_FRAMES) {
            zmq_msg_init(&f[*nf]);
            if (zmq_msg_recv(&f[*nf], sock, ZMQ_DONTWAIT) < 0) {
                zmq_msg_close(&f[*nf]);
                break;                 /* cannot happen: atomic delivery */
            }
            more = zmq_msg_more(&f[*nf]);
            (*nf)++;
        } else {
            zmq_msg_init(&extra);
            if (zmq_msg_recv(&extra, sock, ZMQ_DONTWAIT) < 0) {
                zmq_msg_close(&extra);
                break;
            }
            more = zmq_msg_more(&extra);
            zmq_msg_close(&extra);
            *nf = KV_EVS_FRAMES + 1;
        }
    }
    return 0;
}


static void
evs_frames_close(zmq_msg_t *f, int nf)
{
    int i;

    for (i = 0; i < nf && i < KV_EVS_FRAMES; i++) {
        zmq_msg_close(&f[i]);
    }
}


static int
evs_seq(zmq_msg_t *f, uint64_t *seq)
{
    const uint8_t *b = zmq_msg_data(f);
    int k;

    if (zmq_msg_size(f) != 8) {
        return -1;
    }
    *seq = 0;
    for (k = 0; k < 8; k++) {
        *seq = (*seq << 8) | b[k];
    }
    return 0;
}


static int
evs_topic_ok(evs_src_t *s, zmq_msg_t *f)
{
    size_t n = strlen(s->c->topic);

    return zmq_msg_size(f) == n && memcmp(zmq_msg_data(f), s->c->topic, n)
                                   == 0;
}


static void
evs_bad(evs_src_t *s, const char *why)
{
    uint64_t now = kv_now_ms();

    s->st.bad_frames++;
    if (now - s->t_warn >= 1000) {
        s->t_warn = now;
        kv_warn("kv_events: %s: message dropped: %s (%llu so far)",
                s->c->node, why, (unsigned long long) s->st.bad_frames);
    }
}


static void
evs_replay_poll(struct kv_evs *e, evs_src_t *s)
{
    zmq_msg_t f[KV_EVS_FRAMES];
    uint64_t seq, now;
    int nf, i, base;

    for (i = 0; i < KV_EVS_BATCH && s->replaying; i++) {
        if (evs_recv(s->dealer, f, &nf) != 0) {
            break;
        }
        s->t_last = kv_now_ms();
        /* ["", seq, payload] or ["", topic, seq, payload] */
        base = nf == 4 ? 2 : 1;
        if ((nf != 3 && nf != 4) || zmq_msg_size(&f[0]) != 0
            || evs_seq(&f[base], &seq) != 0
            || (nf == 4 && zmq_msg_size(&f[1]) != 0
                && !evs_topic_ok(s, &f[1])))
        {
            evs_bad(s, "a malformed replay reply");
        } else if (seq == KV_EVS_END_SEQ) {
            evs_frames_close(f, nf);
            evs_replay_end(e, s, 1);
            return;
        } else {
            s->st.replayed++;
            evs_in_order(e, s, seq, zmq_msg_data(&f[base + 1]),
                         zmq_msg_size(&f[base + 1]));
        }
        evs_frames_close(f, nf);
    }
    now = kv_now_ms();
    if (s->replaying
        && (now - s->t_last >= (uint64_t) s->c->replay_timeout_ms
            || now - s->t_start >= 10 * (uint64_t) s->c->replay_timeout_ms))
    {
        /* what we missed is lost for good */
        if (s->have_seq) {
            evs_clear(e, s, s->have_held ? s->held_seq : s->last + 1,
                      KV_EV_CLEAR_GAP);
            s->have_seq = 0;           /* the held message: a new start */
        }
        evs_replay_end(e, s, 0);
    }
}


/* the SUB's monitor: a dropped connection marks the stream as lost */
static void
evs_monitor(evs_src_t *s)
{
    zmq_msg_t f[KV_EVS_FRAMES];
    uint16_t ev;
    int nf;

    while (s->mon && evs_recv(s->mon, f, &nf) == 0) {
        if (nf >= 1 && zmq_msg_size(&f[0]) >= 2) {
            memcpy(&ev, zmq_msg_data(&f[0]), 2);
            if (ev == ZMQ_EVENT_DISCONNECTED) {
                if (!s->lost) {
                    kv_info("kv_events: %s: connection to %s lost",
                            s->c->node, s->c->endpoint);
                }
                s->lost = 1;
                /* libzmq (4.3) reconnects after a network error but not
                 * after a protocol error, and a message over
                 * ZMQ_MAXMSGSIZE is one: the source would be deaf for
                 * good.  A new connection, whatever the cause. */
                zmq_disconnect(s->sub, s->c->endpoint);
                if (zmq_connect(s->sub, s->c->endpoint) != 0) {
                    kv_warn("kv_events: %s: cannot reconnect to %s: %s",
                            s->c->node, s->c->endpoint,
                            zmq_strerror(errno));
                }
            }
        }
        evs_frames_close(f, nf);
    }
}


static void
evs_sub_poll(struct kv_evs *e, evs_src_t *s)
{
    zmq_msg_t f[KV_EVS_FRAMES];
    uint64_t seq;
    int nf, i;

    for (i = 0; i < KV_EVS_BATCH && !s->replaying; i++) {
        if (evs_recv(s->sub, f, &nf) != 0) {
            break;
        }
        if (nf != 3) {
            evs_bad(s, "not three frames (topic, seq, payload)");
        } else if (!evs_topic_ok(s, &f[0])) {
            s->st.other_topic++;       /* a prefix match of the filter */
        } else if (evs_seq(&f[1], &seq) != 0) {
            evs_bad(s, "a sequence frame that is not 8 bytes");
        } else {
            evs_live(e, s, seq, zmq_msg_data(&f[2]), zmq_msg_size(&f[2]));
        }
        evs_frames_close(f, nf);
    }
}


/* slot i: the SUB (+ its monitor) connected to s->own; 0 / -1 */
static int
evs_src_open(struct kv_evs *e, int i)
{
    evs_src_t *s = &e->src[i];
    char mep[64];
    int v;

    s->c = &s->own;
    s->idx = (uint32_t) i;
    s->sub = zmq_socket(e->zctx, ZMQ_SUB);
    if (s->sub == NULL) {
        kv_err("kv_events: %s: no socket: %s", s->c->node,
               zmq_strerror(errno));
        return -1;
    }
    v = 0;
    zmq_setsockopt(s->sub, ZMQ_LINGER, &v, sizeof(v));
    v = KV_EVS_RCVHWM;
    zmq_setsockopt(s->sub, ZMQ_RCVHWM, &v, sizeof(v));
    {
        int64_t max = (int64_t) e->dec.lim.max_payload + 4096;
        zmq_setsockopt(s->sub, ZMQ_MAXMSGSIZE, &max, sizeof(max));
    }
    /* a publisher that froze or vanished without a FIN (a pod gone
     * with its address) shows up as a dropped connection within
     * KV_EVS_HB_TIMEOUT: ZMTP heartbeats, which vLLM's libzmq
     * answers by itself; TCP keepalive for peers without them */
    v = KV_EVS_HB_IVL;
    zmq_setsockopt(s->sub, ZMQ_HEARTBEAT_IVL, &v, sizeof(v));
    v = KV_EVS_HB_TIMEOUT;
    zmq_setsockopt(s->sub, ZMQ_HEARTBEAT_TIMEOUT, &v, sizeof(v));
    v = 1;
    zmq_setsockopt(s->sub, ZMQ_TCP_KEEPALIVE, &v, sizeof(v));
    v = 30;
    zmq_setsockopt(s->sub, ZMQ_TCP_KEEPALIVE_IDLE, &v, sizeof(v));
    v = 5;
    zmq_setsockopt(s->sub, ZMQ_TCP_KEEPALIVE_INTVL, &v, sizeof(v));
    v = 3;
    zmq_setsockopt(s->sub, ZMQ_TCP_KEEPALIVE_CNT, &v, sizeof(v));
    v = 100;
    zmq_setsockopt(s->sub, ZMQ_RECONNECT_IVL, &v, sizeof(v));
    v = 5000;
    zmq_setsockopt(s->sub, ZMQ_RECONNECT_IVL_MAX, &v, sizeof(v));
    v = 1;
    if (strchr(s->c->endpoint, '[')) {
        zmq_setsockopt(s->sub, ZMQ_IPV6, &v, sizeof(v));
    }
    /* ZMQ filters by prefix; evs_topic_ok() then wants it exact */
    zmq_setsockopt(s->sub, ZMQ_SUBSCRIBE, s->c->topic, strlen(s->c->topic));
    /* a slot used again gets a monitor endpoint of its own: the old one
     * may still be bound while libzmq's reaper closes the old socket */
    snprintf(mep, sizeof(mep), "inproc://kv-events-mon-%d-%llu", i,
             (unsigned long long) e->gen++);
    if (zmq_socket_monitor(s->sub, mep, ZMQ_EVENT_DISCONNECTED) == 0) {
        s->mon = zmq_socket(e->zctx, ZMQ_PAIR);
        if (s->mon && zmq_connect(s->mon, mep) != 0) {
            zmq_close(s->mon);
            s->mon = NULL;
        }
        v = 0;
        if (s->mon) {
            zmq_setsockopt(s->mon, ZMQ_LINGER, &v, sizeof(v));
        }
    }
    if (zmq_connect(s->sub, s->c->endpoint) != 0) {
        kv_err("kv_events: %s: cannot connect to %s: %s", s->c->node,
               s->c->endpoint, zmq_strerror(errno));
        return -1;
    }
    kv_info("kv_events: %s (%s): subscribed to %s topic \"%s\"%s%s",
            s->c->node, s->c->http, s->c->endpoint, s->c->topic,
            s->c->replay[0] ? ", replay " : "", s->c->replay);
    return 0;
}


/* slot s: sockets closed, counters logged, the slot free */
static void
evs_src_close(evs_src_t *s)
{
    if (s->used) {
        kv_info("kv_events: %s: %llu messages (%llu refused), %llu "
                "gaps, %llu restarts, %llu replays (%llu ok, %llu "
                "abandoned), %llu malformed", s->c->node,
                (unsigned long long) s->st.msgs,
                (unsigned long long) s->st.refused_msgs,
                (unsigned long long) s->st.gaps,
                (unsigned long long) s->st.restarts,
                (unsigned long long) s->st.replays,
                (unsigned long long) s->st.replays_ok,
                (unsigned long long) s->st.replays_failed,
                (unsigned long long) s->st.bad_frames);
    }
    if (s->sub) {
        zmq_close(s->sub);
    }
    if (s->dealer) {
        zmq_close(s->dealer);
    }
    if (s->mon) {
        zmq_close(s->mon);
    }
    evs_hold_free(s);
    memset(s, 0, sizeof(*s));
}


struct kv_evs *
kv_evs_open(const kv_evs_conf_t *c, const kv_ev_sink_t *sink,
    const kv_ev_limits_t *lim)
{
    struct kv_evs *e;
    int i;

    e = calloc(1, sizeof(*e));
    if (e == NULL) {
        return NULL;
    }
    e->sink = *sink;
    e->src = calloc(KV_EVS_MAX_SOURCES, sizeof(evs_src_t));
    e->zctx = zmq_ctx_new();
    if (e->src == NULL || e->zctx == NULL
        || kv_ev_decoder_init(&e->dec, lim) != 0)
    {
        goto failed;
    }
    for (i = 0; i < c->nsrc && i < KV_EVS_MAX_SOURCES; i++) {
        e->src[i].own = c->src[i];
        e->src[i].used = 1;
        e->nsrc = i + 1;
        if (evs_src_open(e, i) != 0) {
            goto failed;
        }
    }
    return e;

failed:
    kv_evs_close(e);
    return NULL;
}


int
kv_evs_add(struct kv_evs *e, const kv_evs_src_conf_t *c)
{
    int i;

    for (i = 0; i < KV_EVS_MAX_SOURCES; i++) {
        if (!e->src[i].used) {
            break;
        }
    }
    if (i == KV_EVS_MAX_SOURCES) {
        return -1;
    }
    memset(&e->src[i], 0, sizeof(evs_src_t));
    e->src[i].own = *c;
    e->src[i].used = 1;
    if (i >= e->nsrc) {
        e->nsrc = i + 1;
    }
    if (evs_src_open(e, i) != 0) {
        e->src[i].used = 0;            /* nothing to count: no log line */
        evs_src_close(&e->src[i]);
        return -1;
    }
    return i;
}


void
kv_evs_remove(struct kv_evs *e, int i)
{
    if (e == NULL || i < 0 || i >= e->nsrc || !e->src[i].used) {
        return;
    }
    evs_src_close(&e->src[i]);
    while (e->nsrc > 0 && !e->src[e->nsrc - 1].used) {
        e->nsrc--;
    }
}


int
kv_evs_find(struct kv_evs *e, const char *endpoint, const char *http)
{
    int i;

    for (i = 0; e != NULL && i < e->nsrc; i++) {
        if (e->src[i].used
            && (strcmp(e->src[i].own.endpoint, endpoint) == 0
                || (http != NULL && strcmp(e->src[i].own.http, http) == 0)))
        {
            return i;
        }
    }
    return -1;
}


int
kv_evs_free_slots(struct kv_evs *e)
{
    int i, n = 0;

    for (i = 0; e != NULL && i < KV_EVS_MAX_SOURCES; i++) {
        n += !e->src[i].used;
    }
    return n;
}


int
kv_evs_pollfds(struct kv_evs *e, struct pollfd *pfd, int max)
{
    size_t sz;
    int i, fd, n = 0;

    if (e == NULL) {
        return 0;
    }
    for (i = 0; i < e->nsrc && n < max; i++) {
        evs_src_t *s = &e->src[i];
        void *sock = s->replaying ? s->dealer : s->sub;
        if (!s->used) {
            continue;
        }
        sz = sizeof(fd);
        if (sock && zmq_getsockopt(sock, ZMQ_FD, &fd, &sz) == 0) {
            pfd[n].fd = fd;
            pfd[n].events = POLLIN;
            pfd[n].revents = 0;
            n++;
        }
    }
    return n;
}


void
kv_evs_process(struct kv_evs *e)
{
    int i;

    if (e == NULL) {
        return;
    }
    for (i = 0; i < e->nsrc; i++) {
        evs_src_t *s = &e->src[i];
        if (!s->used) {
            continue;
        }
        evs_monitor(s);
        if (s->replaying) {
            evs_replay_poll(e, s);
        }
        if (!s->replaying) {
            evs_sub_poll(e, s);
        }
    }
}


int
kv_evs_nsrc(struct kv_evs *e)
{
    return e ? e->nsrc : 0;
}


void
kv_evs_stats(struct kv_evs *e, int i, kv_evs_src_stats_t *out,
    kv_ev_stats_t *dec)
{
    if (out) {
        *out = e->src[i].st;
    }
    if (dec) {
        *dec = e->dec.st;
    }
}


void
kv_evs_close(struct kv_evs *e)
{
    int i;

    if (e == NULL) {
        return;
    }
    for (i = 0; e->src && i < e->nsrc; i++) {
        evs_src_close(&e->src[i]);
    }
    if (e->zctx) {
        zmq_ctx_term(e->zctx);
    }
    kv_ev_decoder_free(&e->dec);
    free(e->src);
    free(e);
}
