/* Layout tables: each library that takes structs by pointer exports one, giving sizeof of each
   struct and sizeof / offsetof of each of its fields, and its ctypes wrapper checks its Structures
   against it when it loads (layout.py): a field added, dropped or reordered on one side only fails
   loudly there instead of reading the wrong bytes. */
#ifndef KVSERVE_LAYOUT_H
#define KVSERVE_LAYOUT_H
#include <stddef.h>
#include <stdint.h>

typedef struct {
    const char *type;   /* the struct's name */
    const char *field;  /* NULL: the entry for the struct itself (size = sizeof, offset 0) */
    int64_t size, offset;
} KvLayout;

#define KV_LAYOUT_STRUCT(T) {#T, NULL, (int64_t)sizeof(T), 0}
#define KV_LAYOUT_FIELD(T, f) {#T, #f, (int64_t)sizeof(((T *)0)->f), (int64_t)offsetof(T, f)}
/* Defines `void fn(const KvLayout **table, int64_t *n)` exporting the entries that follow. */
#define KV_LAYOUT_TABLE(fn, ...)                                          \
    static const KvLayout fn##_entries[] = {__VA_ARGS__};                 \
    void fn(const KvLayout **table, int64_t *n) {                         \
        *table = fn##_entries;                                            \
        *n = (int64_t)(sizeof(fn##_entries) / sizeof(fn##_entries[0]));   \
    }
#endif /* KVSERVE_LAYOUT_H */
