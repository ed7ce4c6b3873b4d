/*
 * A cJSON tree builder for the request body (ngx_http_dpd_json.c): the
 * tree, the verdict and the error position of libcjson's
 * cJSON_ParseWithLengthOpts(data, len, end, 0) (Debian 12's 1.7.15,
 * whose numbers may be of any length), built in one pass with block
 * copies.  No nginx headers: linked alone with ngx_http_dpd_protocol.c.
 */

#ifndef _NGX_HTTP_DPD_JSON_H_INCLUDED_
#define _NGX_HTTP_DPD_JSON_H_INCLUDED_


#include <stddef.h>
#include <string.h>
#include <cjson/cJSON.h>


/*
 * Parses the value at the start of data[0..len) (after a UTF-8 BOM and
 * white space); *end: just past it, or where the parse failed.  Nodes and
 * strings come from cJSON_malloc() (cJSON's hooks), one per node and per
 * string as cJSON allocates them: cJSON_Delete() frees the tree.
 */
cJSON *ngx_http_dpd_json_parse(const char *data, size_t len,
    const char **end);

/*
 * The same, the nodes and strings from alloc(alloc_data, size) (a pool the
 * caller frees whole: the tree must not go to cJSON_Delete()), carved from
 * blocks of a few KB; a long string has an allocation of its own.
 */
cJSON *ngx_http_dpd_json_parse_in(const char *data, size_t len,
    const char **end, void *(*alloc)(void *data, size_t size),
    void *alloc_data);


/*
 * cJSON's type tests and cJSON_GetObjectItemCaseSensitive() without the
 * library calls (the request's walk makes dozens): the same answers, the
 * first byte telling most keys apart before strcmp()
 */
#define ngx_http_dpd_json_is(j, t)                                           \
    ((j) != NULL && ((j)->type & 0xff) == (t))


static inline const cJSON *
ngx_http_dpd_json_get(const cJSON *obj, const char *name)
{
    const cJSON  *e;

    if (obj == NULL) {
        return NULL;
    }

    /* as cJSON: the first match; a member without a name ends the search */

    for (e = obj->child; e && e->string; e = e->next) {
        if (e->string[0] == name[0] && strcmp(e->string, name) == 0) {
            return e;
        }
    }

    return NULL;
}


#endif /* _NGX_HTTP_DPD_JSON_H_INCLUDED_ */
