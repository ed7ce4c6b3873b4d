/*
 * kv_events_dump.c - `kv_agent events`: what the KV-event decoder and the
 * subscriber make of a publisher's stream (or of payload files), one JSON
 * object a line.  For tests and for looking at a live engine:
 *
 *   kv_agent events --decode FILE...        each file one msgpack payload
 *   kv_agent events --config FILE           the config's "kv_events"
 *   kv_agent events --endpoint EP [--replay EP] [--topic T] [--node N]
 *   with --count N (stop after N messages) and --seconds S (default 10).
 *
 * Lines: {"event":"stored"|"removed"|"cleared", "node", "seq", ...};
 * hashes as strings (decimal for integers, "hex:.." for bytes; "ids":
 * the 64-bit id of each, decimal; "extra_keys": "hex:" of its msgpack
 * bytes); at the end {"event":"stats", ...}.
 */

#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv.h"


typedef struct {
    uint64_t  msgs_seen;
} dump_t;


static void
json_str(const char *s)
{
    const unsigned char *p;

    if (s == NULL) {
        fputs("null", stdout);
        return;
    }
    putchar('"');
    for (p = (const unsigned char *) s; *p; p++) {
        if (*p == '"' || *p == '\\') {
            printf("\\%c", *p);
        } else if (*p < 0x20 || *p == 0x7f) {
            printf("\\u%04x", *p);
        } else {
            putchar(*p);
        }
    }
    putchar('"');
}


static void
json_hash(const kv_ev_hash_t *h)
{
    uint32_t k;

    if (h->rawlen == 0) {
        printf("\"%llu\"", (unsigned long long) h->id);
        return;
    }
    fputs("\"hex:", stdout);
    for (k = 0; k < h->rawlen; k++) {
        printf("%02x", h->raw[k]);
    }
    putchar('"');
}


static void
json_head(const char *ev, const kv_ev_origin_t *o)
{
    printf("{\"event\":\"%s\",\"node\":", ev);
    json_str(o->node);
    printf(",\"seq\":%llu,\"ts\":%.6f,\"dp_rank\":%d",
           (unsigned long long) o->seq, o->ts, (int) o->dp_rank);
}


static void
json_hashes(const kv_ev_hash_t *h, uint32_t n)
{
    uint32_t i;

    fputs(",\"hashes\":[", stdout);
    for (i = 0; i < n; i++) {
        if (i) {
            putchar(',');
        }
        json_hash(&h[i]);
    }
    fputs("],\"ids\":[", stdout);
    for (i = 0; i < n; i++) {
        printf("%s\"%llu\"", i ? "," : "", (unsigned long long) h[i].id);
    }
    putchar(']');
}


static void
dump_stored(void *data, const kv_ev_origin_t *o, const kv_ev_stored_t *ev)
{
    uint32_t i;

    json_head("stored", o);
    json_hashes(ev->hashes, ev->nblocks);
    fputs(",\"parent\":", stdout);
    if (ev->parent) {
        json_hash(ev->parent);
    } else {
        fputs("null", stdout);
    }
    printf(",\"block_size\":%u,\"tokens\":[", ev->block_size);
    for (i = 0; i < ev->ntokens; i++) {
        printf("%s%u", i ? "," : "", ev->tokens[i]);
    }
    printf("],\"tier\":\"%s\",\"medium\":",
           ev->tier == KV_EV_TIER_GPU ? "gpu" : "lower");
    json_str(ev->medium);
    fputs(",\"lora_name\":", stdout);
    json_str(ev->lora_name);
    printf(",\"lora_id\":%lld,\"group_idx\":%d,\"spec_kind\":",
           (long long) ev->lora_id, (int) ev->group_idx);
    json_str(ev->spec_kind);
    fputs(",\"extra_keys\":", stdout);
    if (ev->extra_keys) {
        fputs("\"hex:", stdout);
        for (i = 0; i < ev->extra_keys_len; i++) {
            printf("%02x", ev->extra_keys[i]);
        }
        putchar('"');
    } else {
        fputs("null", stdout);
    }
    fputs("}\n", stdout);
}


static void
dump_removed(void *data, const kv_ev_origin_t *o, const kv_ev_removed_t *ev)
{
    json_head("removed", o);
    json_hashes(ev->hashes, ev->nblocks);
    printf(",\"tier\":\"%s\",\"medium\":",
           ev->tier == KV_EV_TIER_GPU ? "gpu" : "lower");
    json_str(ev->medium);
    printf(",\"group_idx\":%d}\n", (int) ev->group_idx);
}


static void
dump_cleared(void *data, const kv_ev_origin_t *o, kv_ev_clear_t why)
{
    json_head("cleared", o);
    printf(",\"why\":\"%s\"}\n", kv_ev_clear_name(why));
}


static void
dump_dec_stats(const kv_ev_stats_t *st)
{
    printf("\"msgs\":%llu,\"msgs_refused\":%llu,\"stored\":%llu,"
           "\"removed\":%llu,\"cleared\":%llu,\"stored_lower\":%llu,"
           "\"removed_lower\":%llu,\"ignored\":%llu,\"refused\":%llu",
           (unsigned long long) st->msgs,
           (unsigned long long) st->msgs_refused,
           (unsigned long long) st->stored,
           (unsigned long long) st->removed,
           (unsigned long long) st->cleared,
           (unsigned long long) st->stored_lower,
           (unsigned long long) st->removed_lower,
           (unsigned long long) st->ignored,
           (unsigned long long) st->refused);
}


static int
read_file(const char *path, uint8_t **out, size_t *n)
{
    FILE *f = fopen(path, "rb");
    uint8_t *b = NULL, *nb;
    size_t cap = 0, got;

    *n = 0;
    if (f == NULL) {
        return -1;
    }
    for (;;) {
        if (*n == cap) {
            cap = cap ? cap * 2 : 65536;
            if (cap > (size_t) KV_EV_MAX_PAYLOAD * 2) {
                break;                 /* the decoder refuses it anyway */
            }
            nb = realloc(b, cap);
            if (nb == NULL) {
                break;
            }
            b = nb;
        }
        got = fread(b + *n, 1, cap - *n, f);
        *n += got;
        if (got == 0) {
            break;
        }
    }
    fclose(f);
    *out = b;
    return b ? 0 : -1;
}


static int
decode_files(int argc, char **argv, const kv_ev_sink_t *sink)
{
    kv_ev_decoder_t d;
    kv_ev_origin_t o;
    uint8_t *b;
    size_t n;
    int i, r;

    if (kv_ev_decoder_init(&d, NULL) != 0) {
        return 1;
    }
    for (i = 0; i < argc; i++) {
        if (read_file(argv[i], &b, &n) != 0) {
            fprintf(stderr, "kv_agent events: %s: %s\n", argv[i],
                    strerror(errno));
            kv_ev_decoder_free(&d);
            return 1;
        }
        memset(&o, 0, sizeof(o));
        o.node = argv[i];
        o.http = "";
        o.seq = (uint64_t) i;
        r = kv_ev_decode(&d, b, n, &o, sink);
        if (r < 0 || d.why) {
            printf("{\"event\":\"%s\",\"node\":",
                   r < 0 ? "refused_msg" : "refused_event");
            json_str(argv[i]);
            fputs(",\"why\":", stdout);
            json_str(d.why);
            fputs("}\n", stdout);
        }
        free(b);
    }
    fputs("{\"event\":\"stats\",", stdout);
    dump_dec_stats(&d.st);
    fputs("}\n", stdout);
    kv_ev_decoder_free(&d);
    return 0;
}


static volatile sig_atomic_t dump_stop;

static void
dump_sig(int sig)
{
    dump_stop = 1;
}


int
kv_events_main(int argc, char **argv)
{
    kv_ev_sink_t sink = { NULL, dump_stored, dump_removed, dump_cleared };
    static kv_evs_conf_t one;
    const kv_evs_conf_t *conf = NULL;
    kv_config_t *cfg = NULL;
    struct kv_evs *e;
    struct pollfd pfd[KV_EVS_MAX_SOURCES];
    kv_evs_src_stats_t ss;
    kv_ev_stats_t ds;
    uint64_t t_end, count = 0, seen;
    double seconds = 10;
    char err[512];
    int i, n;

    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc >= 1 && strcmp(argv[0], "--decode") == 0) {
        return decode_files(argc - 1, argv + 1, &sink);
    }
    memset(&one, 0, sizeof(one));
    strcpy(one.src[0].node, "engine");
    strcpy(one.src[0].http, "-:0");
    one.src[0].replay_timeout_ms = 2000;
    for (i = 0; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (v == NULL) {
            goto usage;
        }
        i++;
        if (strcmp(a, "--config") == 0) {
            cfg = calloc(1, sizeof(*cfg));
            if (cfg == NULL || kv_config_load(cfg, v, err, sizeof(err))) {
                fprintf(stderr, "kv_agent events: config: %s\n",
                        cfg ? err : "no memory");
                free(cfg);
                return 2;
            }
            conf = &cfg->evs;
        } else if (strcmp(a, "--endpoint") == 0) {
            snprintf(one.src[0].endpoint, KV_EVS_EP_LEN, "%s", v);
            one.nsrc = 1;
            conf = &one;
        } else if (strcmp(a, "--replay") == 0) {
            snprintf(one.src[0].replay, KV_EVS_EP_LEN, "%s", v);
        } else if (strcmp(a, "--topic") == 0) {
            snprintf(one.src[0].topic, KV_EVS_TOPIC_LEN, "%s", v);
        } else if (strcmp(a, "--node") == 0) {
            snprintf(one.src[0].node, KV_ID_LEN, "%s", v);
        } else if (strcmp(a, "--replay-timeout-ms") == 0) {
            one.src[0].replay_timeout_ms = atoi(v);
        } else if (strcmp(a, "--count") == 0) {
            count = strtoull(v, NULL, 10);
        } else if (strcmp(a, "--seconds") == 0) {
            seconds = atof(v);
        } else {
            goto usage;
        }
    }
    if (conf != NULL && conf->ndns > 0) {
        /* a subscriber of fixed endpoints: no resolver here */
        fprintf(stderr, "kv_agent events: %d \"dns\" source%s of the config "
                "not followed here (`kv_agent run` follows them)%s\n",
                conf->ndns, conf->ndns == 1 ? "" : "s",
                conf->nsrc ? "" : "; no other source");
        if (conf->nsrc == 0) {
            free(cfg);
            return 2;
        }
    }
    if (conf == NULL || conf->nsrc == 0) {
        goto usage;
    }
    signal(SIGINT, dump_sig);
    signal(SIGTERM, dump_sig);
    e = kv_evs_open(conf, &sink, NULL);
    if (e == NULL) {
        free(cfg);
        return 1;
    }
    t_end = kv_now_ms() + (uint64_t) (seconds * 1000);
    while (!dump_stop && kv_now_ms() < t_end) {
        n = kv_evs_pollfds(e, pfd, KV_EVS_MAX_SOURCES);
        poll(pfd, (nfds_t) n, 20);
        kv_evs_process(e);
        if (count) {
            seen = 0;
            for (i = 0; i < kv_evs_nsrc(e); i++) {
                kv_evs_stats(e, i, &ss, NULL);
                seen += ss.msgs;
            }
            if (seen >= count) {
                break;
            }
        }
    }
    for (i = 0; i < kv_evs_nsrc(e); i++) {
        kv_evs_stats(e, i, &ss, &ds);
        printf("{\"event\":\"stats\",\"node\":");
        json_str(conf->src[i].node);
        printf(",\"src_msgs\":%llu,\"refused_msgs\":%llu,\"gaps\":%llu,"
               "\"restarts\":%llu,\"reconnects\":%llu,\"clears\":%llu,"
               "\"replays\":%llu,"
               "\"replays_ok\":%llu,\"replays_failed\":%llu,"
               "\"replayed\":%llu,\"dups\":%llu,\"bad_frames\":%llu,"
               "\"other_topic\":%llu,",
               (unsigned long long) ss.msgs,
               (unsigned long long) ss.refused_msgs,
               (unsigned long long) ss.gaps,
               (unsigned long long) ss.restarts,
               (unsigned long long) ss.reconnects,
               (unsigned long long) ss.clears,
               (unsigned long long) ss.replays,
               (unsigned long long) ss.replays_ok,
               (unsigned long long) ss.replays_failed,
               (unsigned long long) ss.replayed,
               (unsigned long long) ss.dups,
               (unsigned long long) ss.bad_frames,
               (unsigned long long) ss.other_topic);
        dump_dec_stats(&ds);
        fputs("}\n", stdout);
    }
    kv_evs_close(e);
    free(cfg);
    return 0;

usage:
    fprintf(stderr, "usage: kv_agent events --decode FILE...\n"
            "       kv_agent events (--config FILE | --endpoint EP "
            "[--replay EP] [--topic T] [--node N])\n"
            "                       [--count MSGS] [--seconds S]\n");
    free(cfg);
    return 2;
}
