/*
 * cJSON's type tests and cJSON_GetObjectItemCaseSensitive() without the
 * library calls, for the walks over a request's tree (the chat template's
 * variables, the gateway's checks: dozens of lookups and tests a
 * request).  The same answers: the type's low byte compared, the first
 * member of a name found, the search ended by a member without a name; the
 * first byte tells most names apart before strcmp().
 */

#ifndef TOK_CJSON_H
#define TOK_CJSON_H

#include <string.h>
#include <cjson/cJSON.h>


#define tok_json_is(j, t)  ((j) != NULL && ((j)->type & 0xff) == (t))


static inline const cJSON *
tok_json_get(const cJSON *obj, const char *name)
{
    const cJSON  *e;

    if (obj == NULL) {
        return NULL;
    }
    for (e = obj->child; e && e->string; e = e->next) {
        if (e->string[0] == name[0] && strcmp(e->string, name) == 0) {
            return e;
        }
    }
    return NULL;
}

#endif /* TOK_CJSON_H */
