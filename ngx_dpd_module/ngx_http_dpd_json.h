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

#include "tokenizer/tok_cjson.h"


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
 * blocks of a few KB; a long string has an allocation of its own.  alloc
 * NULL: cJSON_malloc(), as ngx_http_dpd_json_parse().
 */
cJSON *ngx_http_dpd_json_parse_in(const char *data, size_t len,
    const char **end, void *(*alloc)(void *data, size_t size),
    void *alloc_data);


/* cJSON's type tests and cJSON_GetObjectItemCaseSensitive() inline: the
 * tokenizer's (the same answers, no library call) */
#define ngx_http_dpd_json_is(j, t)     tok_json_is(j, t)
#define ngx_http_dpd_json_get(obj, n)  tok_json_get(obj, n)


#endif /* _NGX_HTTP_DPD_JSON_H_INCLUDED_ */
