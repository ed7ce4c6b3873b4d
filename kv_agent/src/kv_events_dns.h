/*
 * kv_events_dns.h - "kv_events" sources given as a DNS name, re-resolved
 * on a period; each address a source of the subscriber (kv_events_dns.c).
 */

#ifndef KV_EVENTS_DNS_H
#define KV_EVENTS_DNS_H

struct kv_evs;
struct kv_evs_dns;
struct pollfd;
struct kv_pfx_feed;

/* the names of c->dns (kept by reference: c must outlive it); sources
 * are added to evs, index nodes to feed (NULL: no prefix index).  The
 * first lookups start on the first kv_evs_dns_process().  NULL on
 * failure (logged). */
struct kv_evs_dns *kv_evs_dns_open(const kv_evs_conf_t *c,
    struct kv_evs *evs, struct kv_pfx_feed *feed);
int  kv_evs_dns_pollfds(struct kv_evs_dns *d, struct pollfd *pfd, int max);
void kv_evs_dns_process(struct kv_evs_dns *d);      /* never blocks */
/* before kv_evs_close(): never waits for a stuck lookup */
void kv_evs_dns_close(struct kv_evs_dns *d);

#endif /* KV_EVENTS_DNS_H */
