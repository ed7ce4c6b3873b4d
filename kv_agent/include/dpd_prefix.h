/*
 * dpd_prefix.h: the gateway's prefix-cache block keys (issue 23).
 *
 * Header-only, C11, no nginx and no libc beyond <stddef.h>/<stdint.h>:
 * ngx_dpd_module (dpd_prefix_cache) and kv_agent (the KV-events index
 * writer) include the same definition, so a key the agent stores for the
 * token ids of a vLLM BlockStored event is the key the module computes
 * for the same tokens of a prompt.
 *
 * What is keyed.  vLLM's automatic prefix caching (vllm/v1/core/
 * kv_cache_utils.py, hash_block_tokens) caches full blocks only; block k's
 * hash covers its parent's hash, the block's token ids and its extra keys
 * (LoRA name on every block, the request's cache_salt on block 0 only,
 * multimodal hashes).  We do not reproduce vLLM's hash (sha256 over a
 * pickle, seeded by PYTHONHASHSEED; llm-d and Dynamo do not either): the
 * events carry the token ids, and both sides key blocks with this
 * function.  Its structure mirrors vLLM's:
 *
 *   seed   = H(model name, LoRA name)            one per (model, adapter)
 *   h[-1]  = seed                 without a cache_salt ("" counts as none,
 *                                 as vLLM's "if request.cache_salt")
 *          = M(seed, H(salt))     with one: every later key changes too
 *   key[k] = F(h[k-1], ids[k*B .. k*B+B-1])      for each FULL block k
 *   h[k]   = key[k]
 *
 * A trailing partial block has no key (vLLM does not cache it).  The
 * block size B comes from configuration (dpd_prefix_cache block=, the
 * engine's --block-size; vLLM's default 16) and must be the engine's.
 *
 * F is our own: an xxHash64-style accumulation (64-bit lanes of two ids,
 * multiply + rotate) started from the parent key and the block length,
 * finished with the murmur3/splitmix64 avalanche; H is FNV-1a 64 with the
 * same finish.  Not cryptographic: a client can at worst aim its own
 * requests at a decoder, which the load guard bounds; keys never decide
 * correctness (a wrong hit costs a recompute on the engine, never a wrong
 * answer).  Key 0 is never produced (0 marks an empty slot in the events
 * index, dpd_prefix_index.h).
 */

#ifndef DPD_PREFIX_H
#define DPD_PREFIX_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif


#define DPD_PREFIX_DEFAULT_BLOCK   16     /* vLLM's default block size */
#define DPD_PREFIX_MAX_BLOCK       1024

#define DPD_PREFIX_P1  0x9E3779B185EBCA87ULL
#define DPD_PREFIX_P2  0xC2B2AE3D27D4EB4FULL
#define DPD_PREFIX_P3  0x165667B19E3779F9ULL


static inline uint64_t
dpd_prefix_rotl(uint64_t x, unsigned r)
{
    return (x << r) | (x >> (64 - r));
}


/* the avalanche: every input bit flips each output bit with p ~ 1/2 */

static inline uint64_t
dpd_prefix_fmix(uint64_t h)
{
    h ^= h >> 33;
    h *= 0xFF51AFD7ED558CCDULL;
    h ^= h >> 33;
    h *= 0xC4CEB9FE1A85EC53ULL;
    h ^= h >> 33;
    return h;
}


/* a string (not NUL-terminated; NULL with len 0 is the empty string) */

static inline uint64_t
dpd_prefix_hash_str(const void *data, size_t len)
{
    size_t          i;
    uint64_t        h;
    const uint8_t  *p;

    p = (const uint8_t *) data;
    h = 0xCBF29CE484222325ULL;

    for (i = 0; i < len; i++) {
        h ^= p[i];
        h *= 0x100000001B3ULL;
    }

    return dpd_prefix_fmix(h ^ (uint64_t) len);
}


/* the chain's start: model and LoRA name (either may be empty) */

static inline uint64_t
dpd_prefix_seed(const char *model, size_t model_len, const char *lora,
    size_t lora_len)
{
    uint64_t  h;

    h = dpd_prefix_hash_str(model, model_len);
    h ^= dpd_prefix_rotl(dpd_prefix_hash_str(lora, lora_len), 29)
         * DPD_PREFIX_P3;

    return dpd_prefix_fmix(h + DPD_PREFIX_P1);
}


/* the parent of block 0: the seed, with the request's cache_salt mixed in */

static inline uint64_t
dpd_prefix_salted(uint64_t seed, const char *salt, size_t salt_len)
{
    if (salt == NULL || salt_len == 0) {
        return seed;
    }

    return dpd_prefix_fmix(seed ^ dpd_prefix_rotl(
                               dpd_prefix_hash_str(salt, salt_len)
                               * DPD_PREFIX_P2, 31));
}


/* key of one full block of n ids whose parent key is parent */

static inline uint64_t
dpd_prefix_block_key(uint64_t parent, const uint32_t *ids, size_t n)
{
    size_t    i;
    uint64_t  acc, lane;

    acc = parent * DPD_PREFIX_P1 + (uint64_t) n * DPD_PREFIX_P3;

    for (i = 0; i + 1 < n; i += 2) {
        lane = (uint64_t) ids[i] | ((uint64_t) ids[i + 1] << 32);
        acc ^= dpd_prefix_rotl(lane * DPD_PREFIX_P2, 31) * DPD_PREFIX_P1;
        acc = dpd_prefix_rotl(acc, 27) * DPD_PREFIX_P1 + DPD_PREFIX_P3;
    }

    if (i < n) {
        acc ^= (uint64_t) ids[i] * DPD_PREFIX_P1;
        acc = dpd_prefix_rotl(acc, 23) * DPD_PREFIX_P2 + DPD_PREFIX_P3;
    }

    acc = dpd_prefix_fmix(acc ^ parent);

    return acc ? acc : 1;
}


/*
 * The keys of ids[0..n): one per full block of "block" ids, written to
 * keys[0..cap).  parent: dpd_prefix_salted(dpd_prefix_seed(...), salt).
 * Returns the number of full blocks (n / block), which may exceed cap
 * (only cap keys are written); 0 when block is 0.
 */

static inline size_t
dpd_prefix_keys(uint64_t parent, const uint32_t *ids, size_t n, size_t block,
    uint64_t *keys, size_t cap)
{
    size_t  k, nblocks;

    if (block == 0) {
        return 0;
    }

    nblocks = n / block;

    for (k = 0; k < nblocks && k < cap; k++) {
        parent = dpd_prefix_block_key(parent, ids + k * block, block);
        keys[k] = parent;
    }

    return nblocks;
}


#ifdef __cplusplus
}
#endif

#endif /* DPD_PREFIX_H */
