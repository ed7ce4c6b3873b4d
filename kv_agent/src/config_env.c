/*
 * config_env.c - environment substitution in the agent's configuration, so
 * one config serves every replica of a Kubernetes pool: "${POD_NAME}",
 * "${POD_IP}:8000" from the downward API.
 *
 * Rules (kv_agent/README.md, "Configuration from the environment"):
 *   ${NAME}            the variable's value; unset is an error naming the
 *                      key and the variable (set but empty gives "")
 *   ${NAME:-default}   the default (taken literally) when unset or empty
 *   $$                 one '$'
 *   any other '$'      itself (configs written before substitution existed
 *                      keep their meaning)
 * Only string values are expanded, never keys, and the result is not
 * expanded again.  A result with a control character, or longer than
 * KV_ENV_MAX, is refused; each key's own limits then apply as to a literal.
 */

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "kv.h"


#define KV_ENV_MAX       4096           /* an expanded string value */
#define KV_ENV_NAME_MAX  128


static int
env_expand_one(const char *in, const char *where, char *out, size_t olen,
    int *used, char *err, size_t elen)
{
    char name[KV_ENV_NAME_MAX + 1];
    const char *p, *val, *def, *end;
    size_t n, o, dlen, vlen;

    o = 0;
    for (p = in; *p; ) {
        if (p[0] != '$' || (p[1] != '$' && p[1] != '{')) {
            val = p;
            vlen = 1;
            p++;
            goto copy;
        }
        if (p[1] == '$') {
            val = "$";
            vlen = 1;
            p += 2;
            *used = 1;
            goto copy;
        }

        /* ${NAME} or ${NAME:-default} */
        p += 2;
        n = 0;
        if (!(isalpha((unsigned char) *p) || *p == '_')) {
            goto syntax;
        }
        while (isalnum((unsigned char) p[n]) || p[n] == '_') {
            if (n == KV_ENV_NAME_MAX) {
                snprintf(err, elen, "%s: variable name longer than %d",
                         where, KV_ENV_NAME_MAX);
                return -1;
            }
            name[n] = p[n];
            n++;
        }
        name[n] = '\0';
        p += n;
        def = NULL;
        dlen = 0;
        if (p[0] == ':' && p[1] == '-') {
            def = p + 2;
            end = strchr(def, '}');
            if (end == NULL) {
                goto syntax;
            }
            dlen = (size_t) (end - def);
            p = end;
        }
        if (*p != '}') {
            goto syntax;
        }
        p++;
        *used = 1;
        val = getenv(name);
        if (def && (val == NULL || val[0] == '\0')) {
            val = def;
            vlen = dlen;
        } else if (val == NULL) {
            snprintf(err, elen, "%s: environment variable %s is not set "
                     "(write ${%s:-default} for a default)", where, name,
                     name);
            return -1;
        } else {
            vlen = strlen(val);
        }

    copy:
        if (o + vlen >= olen) {
            snprintf(err, elen, "%s: longer than %zu bytes once expanded",
                     where, olen - 1);
            return -1;
        }
        for (n = 0; n < vlen; n++) {
            if ((unsigned char) val[n] < 0x20 || val[n] == 0x7f) {
                snprintf(err, elen, "%s: control character 0x%02x in the "
                         "expanded value", where, (unsigned char) val[n]);
                return -1;
            }
        }
        memcpy(out + o, val, vlen);
        o += vlen;
    }
    out[o] = '\0';
    return 0;

syntax:
    snprintf(err, elen, "%s: bad substitution (write ${NAME}, "
             "${NAME:-default} or $$ for a '$')", where);
    return -1;
}


/* Names whose values are secrets: never printed by `check`. */
static int
secret_key(const char *k)
{
    return k && (strcmp(k, "key") == 0 || strcmp(k, "keys") == 0
                 || strstr(k, "secret") || strstr(k, "token")
                 || strstr(k, "password"));
}


static int
env_walk(cJSON *node, const char *where, int depth, int secret, char *buf,
    int *used, char *err, size_t elen)
{
    char path[256];
    cJSON *e;
    char *s;
    int i, u;

    if (depth > 32) {
        snprintf(err, elen, "%s: nested deeper than 32", where);
        return -1;
    }
    if (cJSON_IsString(node)) {
        u = 0;
        if (env_expand_one(node->valuestring, where, buf, KV_ENV_MAX + 1, &u,
                           err, elen) != 0)
        {
            return -1;
        }
        if (secret && !u) {
            *used |= KV_ENV_LITERAL_SECRET;
        }
        if (u) {
            *used |= KV_ENV_USED;
            s = cJSON_malloc(strlen(buf) + 1);
            if (s == NULL) {
                snprintf(err, elen, "%s: out of memory", where);
                return -1;
            }
            strcpy(s, buf);
            cJSON_free(node->valuestring);
            node->valuestring = s;
        }
        return 0;
    }
    i = 0;
    cJSON_ArrayForEach(e, node) {
        if (cJSON_IsObject(node)) {
            snprintf(path, sizeof(path), "%s%s%s", where,
                     where[0] ? "." : "", e->string);
        } else {
            snprintf(path, sizeof(path), "%s[%d]", where, i);
        }
        if (env_walk(e, path, depth + 1,
                     secret || (cJSON_IsObject(node) && secret_key(e->string)),
                     buf, used, err, elen) != 0)
        {
            return -1;
        }
        i++;
    }
    return 0;
}


int
kv_config_expand(cJSON *root, int *used, char *err, size_t elen)
{
    char *buf;
    int rc;

    *used = 0;
    buf = malloc(KV_ENV_MAX + 1);
    if (buf == NULL) {
        snprintf(err, elen, "out of memory");
        return -1;
    }
    rc = env_walk(root, "", 0, 0, buf, used, err, elen);
    explicit_bzero(buf, KV_ENV_MAX + 1);       /* may have held a key */
    free(buf);
    return rc;
}


/* every string under a secret's name becomes "<redacted>" */
static void
redact_all(cJSON *node)
{
    cJSON *e;
    char *s;

    if (cJSON_IsString(node)) {
        s = cJSON_malloc(sizeof("<redacted>"));
        if (s) {
            strcpy(s, "<redacted>");
            explicit_bzero(node->valuestring, strlen(node->valuestring));
            cJSON_free(node->valuestring);
            node->valuestring = s;
        }
        return;
    }
    cJSON_ArrayForEach(e, node) {
        redact_all(e);
    }
}


static void
redact(cJSON *node)
{
    cJSON *e;

    cJSON_ArrayForEach(e, node) {
        if (secret_key(e->string)) {
            redact_all(e);
        } else {
            redact(e);
        }
    }
}


/*
 * `kv_agent check`: the configuration as `run` reads it, substituted, with
 * secrets redacted.  Called after kv_config_load() accepted the file.
 */
int
kv_config_print_expanded(const char *path, FILE *out)
{
    char err[512], *text;
    cJSON *root;
    FILE *f;
    long n;
    char *buf;
    int used;

    f = fopen(path, "rb");
    if (f == NULL) {
        return -1;
    }
    if (fseek(f, 0, SEEK_END) || (n = ftell(f)) < 0 || n > (1 << 20)
        || fseek(f, 0, SEEK_SET) || (buf = malloc(n + 1)) == NULL)
    {
        fclose(f);
        return -1;
    }
    if (fread(buf, 1, n, f) != (size_t) n) {
        fclose(f);
        free(buf);
        return -1;
    }
    fclose(f);
    root = cJSON_ParseWithLength(buf, n);
    explicit_bzero(buf, n);
    free(buf);
    if (root == NULL) {
        return -1;
    }
    if (kv_config_expand(root, &used, err, sizeof(err)) != 0) {
        cJSON_Delete(root);
        return -1;
    }
    if (used & KV_ENV_USED) {
        redact(root);
        text = cJSON_Print(root);
        if (text) {
            fprintf(out, "expanded config:\n%s\n", text);
            cJSON_free(text);
        }
    }
    cJSON_Delete(root);
    return 0;
}
