/* The shared n-gram trie behind the NGRAM drafter, compiled: plain C99, no Python headers.
 *
 * trie.py loads this file with ctypes (it compiles it on first use) and documents the
 * data structure: streams with frontiers, per-node counts and ranked children, owner-priority
 * follow maps, CLOCK eviction with reused ids, BFS / PROB proposals. The behaviour is the
 * pure-Python original's (tests/ngram_trie_reference.py) down to the node ids: the same ids
 * are created and reused in the same order, so the tests compare whole tries, node by node.
 *
 * Layout:
 * - A node is an int32 id into one array of structs; id 0 is the root, never evicted.
 * - Children are found through one open-addressing table for the whole trie, keyed by
 *   (parent, token), linear probing with backward-shift deletion; a slot holds the whole
 *   key and the child, so probing, deleting and rehashing never read a node. Each node also
 *   lists its children in a doubly linked sibling list, walked only to re-rank after an
 *   eviction.
 * - Speed comes from memory-level parallelism: the look-ups of one token at each frontier
 *   level are independent, as are the walks of a context's suffixes, so their cache misses
 *   are all started (prefetched) before any is waited for.
 * - A node's ranking: its max_bfs_breadth best children by (count, stamp) descending
 *   (stamps of siblings never tie: one token per clock tick). Nine nodes in ten have one
 *   child, so a ranking of one lives in the node itself; a longer one gets a row of a pool.
 * - A stream (one owner, or one anonymous insert) keeps its frontier, its last tokens, and
 *   (owner priority) a follow map node -> (gen, token): open addressing, never shrunk.
 * - Memory for a slice of tokens is reserved before the slice is fed, so feeding never
 *   fails; a failed allocation returns an error with the tokens before it indexed and every
 *   structure consistent.
 *
 * Return codes: >= 0 success, -1 out of memory, -2 bad argument (an unknown stream slot, a
 * node id out of range, an output buffer too small).
 *
 * ngt_insert and ngt_propose take int32 scalars only (besides pointers): trie.py calls
 * them without ctypes argument conversion, which costs more than the work of a short call.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH(address) __builtin_prefetch(address)
#else
#define PREFETCH(address) ((void)(address))
#endif

#define NO_MEMORY (-1)
#define BAD_ARGUMENT (-2)

typedef struct {
    int64_t count;   /* occurrences of the node's n-gram */
    int64_t stamp;   /* clock of the last count increment: recency, ranking tie-break */
    int32_t token;
    int32_t parent;  /* -1: a free id (or the root) */
    int32_t first_child, next_sibling, prev_sibling;  /* 0: none (the root is nobody's child) */
    uint32_t gen;    /* incarnation of a reused id */
    int32_t top;     /* top_len 1: the best child; top_len >= 2: the ranking's row in `rows` */
    int16_t top_len;
    uint8_t touched; /* count grew since (re)queued for eviction (the original's stamp > queued) */
} Node;

typedef struct {
    int32_t child;  /* 0: empty */
    int32_t parent, token;
} Slot;

typedef struct {
    int32_t node;   /* 0: empty (the root has no follow entry) */
    int32_t token;
    uint32_t gen;
} FollowSlot;

typedef struct {
    FollowSlot *slots;
    int64_t mask, used;
} FollowMap;

typedef struct {
    int32_t *frontier;  /* [max_depth]: frontier[k] is the node of the k-gram ending at the
                           last token, -1 when evicted (not extended any more); [0] = root */
    int32_t *tail;      /* [max_depth - 1]: the last tokens, to look the frontier up again */
    int32_t frontier_len, tail_len;
    int64_t epoch;      /* the trie's eviction epoch the frontier is valid for */
    int32_t in_use, with_follow;
    FollowMap follow;
} Stream;

typedef struct {
    double prob, parent_prob;
    int64_t seq;  /* push order: ties go to the earlier push */
    int32_t kid, parent, own, rank, parent_index, kids_off, kids_len;
} HeapEntry;

typedef struct {
    /* config */
    int64_t capacity, target, chunk;
    int32_t min_window, max_window, breadth, depth, prob;
    int32_t *breadths;  /* [(max_window + 1) * (depth + 1)]: children expanded per node */

    /* nodes; every per-node array has node_cap entries (a power of two) */
    Node *nodes;
    int32_t *rows;      /* [rows_cap * breadth]: rankings of nodes with two children or more */
    int32_t *free_rows; /* a stack */
    int64_t rows_cap, rows_used, num_free_rows;
    int32_t *free_ids;  /* a stack */
    int32_t *queue;     /* a ring: CLOCK order */
    int32_t *batch;     /* eviction scratch */
    int64_t node_cap, next_id, num_free, queue_head, queue_len;
    Slot *table;
    int64_t table_mask, table_used;
    int64_t num_nodes, clock, epoch;

    /* streams */
    Stream *streams;
    int32_t *free_streams;
    int64_t num_streams, streams_cap, num_free_streams;
    Stream anon;
    int32_t *next_frontier, *found;  /* [depth + 1] each: feed's scratch */
    int32_t *rank_buf;               /* [breadth] */
    uint64_t *hashes;                /* [depth + 1] */
    int32_t *suffix_nodes, *walk_cur, *walk_active;  /* [depth + 1] each: walk_suffixes's */

    /* proposal output, registered by ngt_set_output: tokens then parents */
    int32_t *out;
    int64_t out_cap;

    /* proposal scratch, for budgets up to scratch_budget */
    int64_t scratch_budget;
    void *scratch;
    HeapEntry *heap;
    int32_t *window, *a_tokens, *a_parents, *b_tokens, *b_parents, *mapped, *child_head,
        *child_next, *cur_nodes, *cur_index, *next_nodes, *next_index, *ranked_buf, *kids,
        *depth_of, *depth_start;
} Trie;

/* ------------------------------------------------------------------ hashing */

static inline uint64_t mix64(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return x;
}

static inline uint64_t child_hash(int32_t parent, int32_t token) {
    return mix64(((uint64_t)(uint32_t)parent << 32) | (uint32_t)token);
}

/* The child, 0 when absent; `hash` is child_hash(parent, token). */
static inline int32_t find_child(const Trie *t, int32_t parent, int32_t token, uint64_t hash) {
    uint64_t i = hash & (uint64_t)t->table_mask;
    for (;;) {
        const Slot *slot = &t->table[i];
        if (slot->child == 0) return 0;
        if (slot->token == token && slot->parent == parent) return slot->child;
        i = (i + 1) & (uint64_t)t->table_mask;
    }
}

static inline int32_t child_of(const Trie *t, int32_t parent, int32_t token) {
    return find_child(t, parent, token, child_hash(parent, token));
}

static void table_put(Slot *table, int64_t mask, Slot entry) {
    uint64_t i = child_hash(entry.parent, entry.token) & (uint64_t)mask;
    while (table[i].child) i = (i + 1) & (uint64_t)mask;
    table[i] = entry;
}

static void table_remove(Trie *t, int32_t child) {
    const uint64_t mask = (uint64_t)t->table_mask;
    uint64_t i = child_hash(t->nodes[child].parent, t->nodes[child].token) & mask;
    while (t->table[i].child != child) {
        if (!t->table[i].child) return;  /* absent: cannot happen, ngt_check says so */
        i = (i + 1) & mask;
    }
    /* Backward shift: an entry after the hole moves into it unless its home slot lies
       cyclically in (hole, entry], so that every probe sequence stays unbroken. */
    uint64_t j = i;
    for (;;) {
        j = (j + 1) & mask;
        Slot slot = t->table[j];
        if (!slot.child) break;
        uint64_t home = child_hash(slot.parent, slot.token) & mask;
        if (((j - home) & mask) >= ((j - i) & mask)) {
            t->table[i] = slot;
            i = j;
        }
    }
    t->table[i].child = 0;
    t->table_used--;
}

static int table_reserve(Trie *t, int64_t extra) {
    int64_t size = t->table_mask + 1;
    if ((t->table_used + extra) * 2 <= size) return 0;
    while ((t->table_used + extra) * 2 > size) size *= 2;
    Slot *table = calloc((size_t)size, sizeof *table);
    if (!table) return NO_MEMORY;
    /* Each entry lands at random in the new table: prefetch a block's landing slots first. */
    const uint64_t mask = (uint64_t)size - 1;
    for (int64_t block = 0; block <= t->table_mask; block += 32) {
        int64_t end = block + 32 <= t->table_mask + 1 ? block + 32 : t->table_mask + 1;
        for (int64_t i = block; i < end; i++)
            if (t->table[i].child)
                PREFETCH(&table[child_hash(t->table[i].parent, t->table[i].token) & mask]);
        for (int64_t i = block; i < end; i++)
            if (t->table[i].child) table_put(table, size - 1, t->table[i]);
    }
    free(t->table);
    t->table = table;
    t->table_mask = size - 1;
    return 0;
}

static const FollowSlot *follow_find(const FollowMap *map, int32_t node) {
    uint64_t i = mix64((uint32_t)node) & (uint64_t)map->mask;
    for (;;) {
        const FollowSlot *slot = &map->slots[i];
        if (slot->node == node) return slot;
        if (slot->node == 0) return NULL;
        i = (i + 1) & (uint64_t)map->mask;
    }
}

static inline void follow_set(FollowMap *map, int32_t node, uint32_t gen, int32_t token) {
    uint64_t i = mix64((uint32_t)node) & (uint64_t)map->mask;
    FollowSlot *slot = &map->slots[i];
    while (slot->node != node && slot->node != 0) {
        i = (i + 1) & (uint64_t)map->mask;
        slot = &map->slots[i];
    }
    if (slot->node == 0) map->used++;
    slot->node = node;
    slot->gen = gen;
    slot->token = token;
}

static int follow_reserve(FollowMap *map, int64_t extra) {
    int64_t size = map->mask + 1;
    if ((map->used + extra) * 2 <= size) return 0;
    while ((map->used + extra) * 2 > size) size *= 2;
    FollowSlot *slots = calloc((size_t)size, sizeof *slots);
    if (!slots) return NO_MEMORY;
    for (int64_t i = 0; i <= map->mask; i++) {
        FollowSlot slot = map->slots[i];
        if (!slot.node) continue;
        uint64_t j = mix64((uint32_t)slot.node) & (uint64_t)(size - 1);
        while (slots[j].node) j = (j + 1) & (uint64_t)(size - 1);
        slots[j] = slot;
    }
    free(map->slots);
    map->slots = slots;
    map->mask = size - 1;
    return 0;
}

/* ------------------------------------------------------------------ nodes */

static inline int better(const Node *nodes, int32_t a, int32_t b) {
    return nodes[a].count > nodes[b].count ||
           (nodes[a].count == nodes[b].count && nodes[a].stamp > nodes[b].stamp);
}

/* Room for `extra` more nodes without reallocating while a chunk is fed. */
static int nodes_reserve(Trie *t, int64_t extra) {
    int64_t fresh = extra > t->num_free ? extra - t->num_free : 0;
    int64_t need = t->next_id + fresh;
    if (need <= t->node_cap) return 0;
    if (need > INT32_MAX) return NO_MEMORY;
    int64_t cap = t->node_cap;
    while (cap < need) cap *= 2;
    /* Each array that grew is kept even if a later one fails: node_cap only moves at the end. */
    Node *nodes = realloc(t->nodes, (size_t)cap * sizeof *nodes);
    if (!nodes) return NO_MEMORY;
    t->nodes = nodes;
    int32_t *free_ids = realloc(t->free_ids, (size_t)cap * sizeof *free_ids);
    if (!free_ids) return NO_MEMORY;
    t->free_ids = free_ids;
    int32_t *batch = realloc(t->batch, (size_t)cap * sizeof *batch);
    if (!batch) return NO_MEMORY;
    t->batch = batch;
    int32_t *queue = malloc((size_t)cap * sizeof *queue);
    if (!queue) return NO_MEMORY;
    for (int64_t i = 0; i < t->queue_len; i++)
        queue[i] = t->queue[(t->queue_head + i) & (t->node_cap - 1)];
    free(t->queue);
    t->queue = queue;
    t->queue_head = 0;
    t->node_cap = cap;
    return 0;
}

/* Room for `extra` more ranking rows (a row per node at most). */
static int rows_reserve(Trie *t, int64_t extra) {
    int64_t fresh = extra > t->num_free_rows ? extra - t->num_free_rows : 0;
    int64_t need = t->rows_used + fresh;
    if (need > t->node_cap) need = t->node_cap;
    if (need <= t->rows_cap) return 0;
    int64_t cap = t->rows_cap ? t->rows_cap : 64;
    while (cap < need) cap *= 2;
    int32_t *rows = realloc(t->rows, (size_t)cap * (size_t)t->breadth * sizeof *rows);
    if (!rows) return NO_MEMORY;
    t->rows = rows;
    int32_t *free_rows = realloc(t->free_rows, (size_t)cap * sizeof *free_rows);
    if (!free_rows) return NO_MEMORY;
    t->free_rows = free_rows;
    t->rows_cap = cap;
    return 0;
}

static inline int32_t *row_of(const Trie *t, int32_t row) {
    return t->rows + (size_t)row * (size_t)t->breadth;
}

/* A node's ranking, top_len entries. */
static inline const int32_t *top_of(const Trie *t, int32_t node) {
    const Node *n = &t->nodes[node];
    return n->top_len >= 2 ? row_of(t, n->top) : &n->top;
}

static inline void queue_push(Trie *t, int32_t node) {
    t->queue[(t->queue_head + t->queue_len) & (t->node_cap - 1)] = node;
    t->queue_len++;
}

static int32_t create_child(Trie *t, int32_t parent, int32_t token) {
    int32_t child;
    Node *nodes = t->nodes;
    if (t->num_free) {
        child = t->free_ids[--t->num_free];
        nodes[child].gen++;
    } else {
        child = (int32_t)t->next_id++;
        nodes[child].gen = 0;
    }
    Node *node = &nodes[child];
    node->token = token;
    node->parent = parent;
    node->count = 1;
    node->stamp = t->clock;
    node->touched = 0;
    node->first_child = 0;
    node->top_len = 0;
    node->prev_sibling = 0;
    node->next_sibling = nodes[parent].first_child;
    if (node->next_sibling) nodes[node->next_sibling].prev_sibling = child;
    nodes[parent].first_child = child;
    Slot entry = {child, parent, token};
    table_put(t->table, t->table_mask, entry);
    t->table_used++;
    queue_push(t, child);
    t->num_nodes++;
    return child;
}

/* `node`'s ranking after `child`'s count grew by one. `child` is the most recently updated,
   so it goes before every child of equal count; a count only grows, so it only moves up. */
static void promote(Trie *t, int32_t node, int32_t child) {
    Node *nodes = t->nodes, *n = &nodes[node];
    int32_t len = n->top_len;
    int64_t count = nodes[child].count;
    if (len == 0) {
        n->top = child;
        n->top_len = 1;
        return;
    }
    if (len == 1) {
        int32_t first = n->top;
        if (first == child) return;
        if (t->breadth == 1) {
            if (nodes[first].count <= count) n->top = child;
            return;
        }
        int32_t row = t->num_free_rows ? t->free_rows[--t->num_free_rows] : (int32_t)t->rows_used++;
        int32_t *top = row_of(t, row);
        int first_stays = nodes[first].count > count;
        top[0] = first_stays ? first : child;
        top[1] = first_stays ? child : first;
        n->top = row;
        n->top_len = 2;
        return;
    }
    int32_t *top = row_of(t, n->top);
    if (top[0] == child) return;
    int32_t pos = -1;
    for (int32_t i = 0; i < len; i++) {
        if (top[i] == child) {
            pos = i;
            break;
        }
    }
    if (pos >= 0) {
        memmove(top + pos, top + pos + 1, (size_t)(len - pos - 1) * sizeof *top);
        len--;
    } else if (len == t->breadth) {
        if (nodes[top[len - 1]].count > count) return;
        len--;
    }
    int32_t at = 0;
    while (at < len && nodes[top[at]].count > count) at++;
    memmove(top + at + 1, top + at, (size_t)(len - at) * sizeof *top);
    top[at] = child;
    n->top_len = (int16_t)(len + 1);
}

/* The best `breadth` children by (count, stamp) descending, written to `top`. */
static int32_t rank_children(const Trie *t, int32_t node, int32_t *top) {
    const Node *nodes = t->nodes;
    int32_t len = 0, breadth = t->breadth;
    for (int32_t child = nodes[node].first_child; child; child = nodes[child].next_sibling) {
        if (len == breadth && !better(nodes, child, top[len - 1])) continue;
        int32_t at = len < breadth ? len++ : breadth - 1;
        while (at > 0 && better(nodes, child, top[at - 1])) {
            top[at] = top[at - 1];
            at--;
        }
        top[at] = child;
    }
    return len;
}

/* After a child in the ranking was evicted: a ranking has as many entries as children, up to
   breadth, so it only shrinks and needs no new row. */
static void rerank(Trie *t, int32_t node) {
    Node *n = &t->nodes[node];
    int32_t *ranked = t->rank_buf;
    int32_t len = rank_children(t, node, ranked);
    if (n->top_len >= 2 && len >= 2) {
        memcpy(row_of(t, n->top), ranked, (size_t)len * sizeof *ranked);
    } else {
        if (n->top_len >= 2) t->free_rows[t->num_free_rows++] = n->top;
        n->top = len ? ranked[0] : 0;
    }
    n->top_len = (int16_t)len;
}

static void remove_leaf(Trie *t, int32_t id) {
    Node *nodes = t->nodes, *node = &nodes[id];
    int32_t parent = node->parent;
    table_remove(t, id);
    if (node->prev_sibling) nodes[node->prev_sibling].next_sibling = node->next_sibling;
    else nodes[parent].first_child = node->next_sibling;
    if (node->next_sibling) nodes[node->next_sibling].prev_sibling = node->prev_sibling;
    if (parent) {  /* the root keeps no ranking */
        Node *p = &nodes[parent];
        const int32_t *top = top_of(t, parent);
        for (int32_t i = 0; i < p->top_len; i++) {
            if (top[i] == id) {
                rerank(t, parent);
                break;
            }
        }
    }
    node->parent = -1;
    node->top_len = 0;
    t->free_ids[t->num_free++] = id;
    t->num_nodes--;
}

#define EVICT_AHEAD 16

/* CLOCK over leaves: take the oldest queue entries, newest first (in creation order a child
   follows its parent, so a cold chain goes leaf first and its parent is a leaf by its turn);
   evict a leaf not touched since queued, requeue everything else. */
static void evict(Trie *t) {
    const int64_t mask = t->node_cap - 1;
    while (t->num_nodes > t->target && t->queue_len > 0) {
        int64_t take = t->num_nodes - t->target;
        if (take > t->queue_len) take = t->queue_len;
        for (int64_t i = 0; i < take; i++) t->batch[i] = t->queue[(t->queue_head + i) & mask];
        t->queue_head = (t->queue_head + take) & mask;
        t->queue_len -= take;
        for (int64_t i = take - 1; i >= 0; i--) {
            /* A leaf's eviction reads its node, then its slot, its parent and its siblings:
               started ahead. (In the loop itself: GCC drops a call to a function that only
               prefetches, as free of side effects.) */
            const Node *nodes = t->nodes;
            if (i >= 2 * EVICT_AHEAD) PREFETCH(&nodes[t->batch[i - 2 * EVICT_AHEAD]]);
            if (i >= EVICT_AHEAD) {
                /* Whether it will be a leaf by its turn is not known yet: its children
                   (created a level deeper, a token later) are often evicted in between. */
                const Node *ahead = &nodes[t->batch[i - EVICT_AHEAD]];
                PREFETCH(&t->table[child_hash(ahead->parent, ahead->token) & (uint64_t)t->table_mask]);
                PREFETCH(&nodes[ahead->parent]);
                PREFETCH(&nodes[ahead->prev_sibling]);
                PREFETCH(&nodes[ahead->next_sibling]);
            }
            int32_t id = t->batch[i];
            Node *node = &t->nodes[id];
            if (node->touched || node->first_child) {
                node->touched = 0;
                queue_push(t, id);
            } else {
                remove_leaf(t, id);
            }
        }
    }
    t->epoch++;
}

/* ------------------------------------------------------------------ insertion */

static int32_t walk(const Trie *t, const int32_t *tokens, int32_t n) {
    int32_t node = 0;
    for (int32_t i = 0; i < n; i++) {
        node = child_of(t, node, tokens[i]);
        if (!node) return -1;
    }
    return node;
}

/* out[L] = walk(tokens[n - L:]) for L in [min_length, n] where known is NULL or known[L] < 0
   (else known[L]): all the suffixes walked at once, one token of each per round, so that a
   round's look-ups overlap. n <= depth. */
static void walk_suffixes(Trie *t, const int32_t *tokens, int32_t n, int32_t min_length,
                          const int32_t *known, int32_t *out) {
    int32_t *cur = t->walk_cur, *active = t->walk_active, num_active = 0;
    uint64_t *hashes = t->hashes;
    for (int32_t length = min_length; length <= n; length++) {
        if (known && known[length] >= 0) {
            out[length] = known[length];
        } else {
            cur[length] = 0;
            active[num_active++] = length;
        }
    }
    for (int32_t step = 0; num_active > 0; step++) {
        for (int32_t a = 0; a < num_active; a++) {
            int32_t length = active[a];
            hashes[length] = child_hash(cur[length], tokens[n - length + step]);
            PREFETCH(&t->table[hashes[length] & (uint64_t)t->table_mask]);
        }
        int32_t still = 0;
        for (int32_t a = 0; a < num_active; a++) {
            int32_t length = active[a];
            int32_t child = find_child(t, cur[length], tokens[n - length + step], hashes[length]);
            if (!child) {
                out[length] = -1;
            } else if (step + 1 == length) {
                out[length] = child;
            } else {
                cur[length] = child;
                active[still++] = length;
            }
        }
        num_active = still;
    }
}

/* After an eviction, look the frontier up again from the last tokens; an n-gram whose node
   was evicted is not extended any more (-1). */
static void refind_frontier(Trie *t, Stream *s) {
    s->frontier[0] = 0;
    walk_suffixes(t, s->tail, s->tail_len, 1, NULL, s->frontier);
    s->frontier_len = s->tail_len + 1;
    s->epoch = t->epoch;
}

static void feed(Trie *t, Stream *s, const int32_t *tokens, int64_t n) {
    FollowMap *follow = s->with_follow ? &s->follow : NULL;
    int32_t *next = t->next_frontier, *found = t->found;
    uint64_t *hashes = t->hashes;
    for (int64_t i = 0; i < n; i++) {
        int32_t token = tokens[i], len = 1;
        t->clock++;
        /* The look-ups of the levels are independent: start every level's memory loads,
           then resolve the look-ups (their children's loads start), then update in order
           (creating a child at one level cannot create another level's). */
        for (int32_t k = 0; k < s->frontier_len; k++) {
            int32_t node = s->frontier[k];
            if (node < 0) continue;
            hashes[k] = child_hash(node, token);
            PREFETCH(&t->table[hashes[k] & (uint64_t)t->table_mask]);
            PREFETCH(&t->nodes[node]);
            if (follow && node) PREFETCH(&follow->slots[mix64((uint32_t)node) & (uint64_t)follow->mask]);
        }
        int64_t reuse = t->num_free;  /* creations take ids from the top of the free stack */
        for (int32_t k = 0; k < s->frontier_len; k++) {
            int32_t node = s->frontier[k];
            if (node < 0) continue;
            if (node && t->nodes[node].top_len >= 2) PREFETCH(row_of(t, t->nodes[node].top));
            found[k] = find_child(t, node, token, hashes[k]);
            if (found[k]) {
                PREFETCH(&t->nodes[found[k]]);
            } else {
                PREFETCH(&t->nodes[t->nodes[node].first_child]);
                if (reuse > 0) PREFETCH(&t->nodes[t->free_ids[--reuse]]);
            }
        }
        next[0] = 0;
        for (int32_t k = 0; k < s->frontier_len; k++) {
            int32_t node = s->frontier[k];
            if (node < 0) {
                next[len++] = -1;
                continue;
            }
            int32_t child = found[k];
            if (!child) {
                child = create_child(t, node, token);
            } else {
                t->nodes[child].count++;
                t->nodes[child].stamp = t->clock;
                t->nodes[child].touched = 1;
            }
            if (node) {  /* the root keeps no ranking and no follow: no match stops there */
                promote(t, node, child);
                if (follow) follow_set(follow, node, t->nodes[node].gen, token);
            }
            next[len++] = child;
        }
        if (len > t->depth) len--;  /* an n-gram of max_depth is not extended */
        memcpy(s->frontier, next, (size_t)len * sizeof *next);
        s->frontier_len = len;
    }
}

static void update_tail(const Trie *t, Stream *s, const int32_t *tokens, int64_t n) {
    int32_t cap = t->depth - 1;
    if (n >= cap) {
        memcpy(s->tail, tokens + n - cap, (size_t)cap * sizeof *tokens);
        s->tail_len = cap;
        return;
    }
    int32_t keep = s->tail_len < cap - (int32_t)n ? s->tail_len : cap - (int32_t)n;
    memmove(s->tail, s->tail + s->tail_len - keep, (size_t)keep * sizeof *tokens);
    memcpy(s->tail + keep, tokens, (size_t)n * sizeof *tokens);
    s->tail_len = keep + (int32_t)n;
}

static Stream *stream_at(Trie *t, int32_t slot) {
    if (slot < 0 || slot >= t->num_streams || !t->streams[slot].in_use) return NULL;
    return &t->streams[slot];
}

#define RESERVE_SLICE 256

/* Index every n-gram (up to max_depth long) ending in `tokens`, continuing stream `slot`
   (-1: a stream of its own). In chunks, so that eviction overshoots capacity by half at most. */
int64_t ngt_insert(Trie *t, const int32_t *tokens, int32_t n, int32_t slot) {
    Stream *s = &t->anon;
    if (slot >= 0) {
        s = stream_at(t, slot);
        if (!s) return BAD_ARGUMENT;
    } else {
        s->frontier[0] = 0;
        s->frontier_len = 1;
        s->tail_len = 0;
        s->epoch = t->epoch;
    }
    for (int64_t start = 0; start < n; start += t->chunk) {
        int64_t size = n - start < t->chunk ? n - start : t->chunk;
        if (s->epoch != t->epoch) refind_frontier(t, s);
        /* Memory is reserved for a slice at a time (a chunk may be huge): a failure leaves
           the tokens before it indexed and the stream consistent. */
        for (int64_t done = 0; done < size; done += RESERVE_SLICE) {
            int64_t slice = size - done < RESERVE_SLICE ? size - done : RESERVE_SLICE;
            int64_t most = slice * t->depth;  /* nodes created, at most */
            if (nodes_reserve(t, most) || rows_reserve(t, most) || table_reserve(t, most) ||
                (s->with_follow && follow_reserve(&s->follow, slice * (t->depth - 1))))
                return NO_MEMORY;
            feed(t, s, tokens + start + done, slice);
            update_tail(t, s, tokens + start + done, slice);
        }
        if (t->num_nodes > t->capacity) evict(t);
    }
    return 0;
}

/* ngt_insert for several streams in one call: stream i gets tokens[offsets[i]:offsets[i + 1]]
   (slots[i] as ngt_insert's slot), in order. The writer thread's job of a flush is ~64
   streams of a few tokens each: a call per stream took the GIL back after each, stalling
   the step loop once per stream. Stops at the first error (the streams before it indexed). */
int64_t ngt_insert_many(Trie *t, const int32_t *tokens, const int64_t *offsets, const int32_t *slots,
                        int64_t count) {
    for (int64_t i = 0; i < count; i++) {
        int64_t n = offsets[i + 1] - offsets[i];
        if (n < 0 || n > INT32_MAX) return BAD_ARGUMENT;
        if (n == 0) continue;
        int64_t result = ngt_insert(t, tokens + offsets[i], (int32_t)n, slots[i]);
        if (result < 0) return result;
    }
    return 0;
}

/* ------------------------------------------------------------------ streams */

int64_t ngt_stream_new(Trie *t, int32_t with_follow) {
    int64_t slot;
    if (t->num_free_streams) {
        slot = t->free_streams[--t->num_free_streams];
    } else {
        if (t->num_streams == t->streams_cap) {
            int64_t cap = t->streams_cap ? 2 * t->streams_cap : 16;
            if (cap > INT32_MAX) return NO_MEMORY;
            Stream *streams = realloc(t->streams, (size_t)cap * sizeof *streams);
            if (!streams) return NO_MEMORY;
            t->streams = streams;
            int32_t *free_streams = realloc(t->free_streams, (size_t)cap * sizeof *free_streams);
            if (!free_streams) return NO_MEMORY;
            t->free_streams = free_streams;
            t->streams_cap = cap;
        }
        slot = t->num_streams;
    }
    Stream *s = &t->streams[slot];
    memset(s, 0, sizeof *s);
    s->frontier = malloc((size_t)(2 * t->depth) * sizeof *s->frontier);
    if (!s->frontier) goto fail;
    s->tail = s->frontier + t->depth;
    if (with_follow) {
        s->follow.slots = calloc(16, sizeof *s->follow.slots);
        if (!s->follow.slots) goto fail;
        s->follow.mask = 15;
        s->with_follow = 1;
    }
    s->frontier[0] = 0;
    s->frontier_len = 1;
    s->epoch = t->epoch;
    s->in_use = 1;
    if (slot == t->num_streams) t->num_streams++;
    return slot;
fail:
    free(s->frontier);
    s->frontier = NULL;
    if (slot < t->num_streams) t->free_streams[t->num_free_streams++] = (int32_t)slot;
    return NO_MEMORY;
}

int64_t ngt_stream_release(Trie *t, int32_t slot) {
    Stream *s = stream_at(t, slot);
    if (!s) return BAD_ARGUMENT;
    free(s->frontier);
    free(s->follow.slots);
    memset(s, 0, sizeof *s);
    t->free_streams[t->num_free_streams++] = slot;
    return 0;
}

/* ------------------------------------------------------------------ proposal */

/* What ranked(node) will read: the ranking row and the owner's follow entry. (A macro: GCC
   drops a call to a function that only prefetches.) */
#define prefetch_ranking(t, node, follow)                                                    \
    do {                                                                                      \
        if ((t)->nodes[node].top_len >= 2) PREFETCH(row_of((t), (t)->nodes[node].top));      \
        if (follow)                                                                           \
            PREFETCH(&(follow)->slots[mix64((uint32_t)(node)) & (uint64_t)(follow)->mask]);   \
    } while (0)

typedef struct {
    const int32_t *nodes;  /* nodes[L]: the node of the window's last L tokens, -1 none */
    int32_t length;        /* the next suffix length to try */
} MatchIter;

/* The suffixes of the window (n <= max_window) are all looked up at once; a stream's
   frontier, when the stream ends exactly with the window, gives them for free (frontier[k]:
   the node of window[-k:]). */
static void matches_begin(Trie *t, MatchIter *it, const int32_t *window, int32_t n,
                          const Stream *s) {
    const int32_t *known = NULL;
    if (s && s->epoch == t->epoch && s->tail_len >= n &&
        (n == 0 || !memcmp(s->tail + s->tail_len - n, window, (size_t)n * sizeof *window)))
        known = s->frontier;
    walk_suffixes(t, window, n, t->min_window, known, t->suffix_nodes);
    /* The matches are expanded next: start loading the suffixes' nodes, then what their
       expansion reads first (rankings, follow entries, best children). */
    const FollowMap *follow = s && s->with_follow ? &s->follow : NULL;
    for (int32_t length = t->min_window; length <= n; length++)
        if (t->suffix_nodes[length] >= 0) PREFETCH(&t->nodes[t->suffix_nodes[length]]);
    for (int32_t length = t->min_window; length <= n; length++) {
        int32_t node = t->suffix_nodes[length];
        if (node <= 0 || !t->nodes[node].first_child) continue;
        prefetch_ranking(t, node, follow);
        if (t->nodes[node].top_len == 1) PREFETCH(&t->nodes[t->nodes[node].top]);
    }
    it->nodes = t->suffix_nodes;
    it->length = n;
}

/* The next suffix of the window, longest first, that has a continuation. */
static int matches_next(const Trie *t, MatchIter *it, int32_t *node_out, int32_t *length_out) {
    while (it->length >= t->min_window) {
        int32_t length = it->length--;
        int32_t node = it->nodes[length];
        if (node >= 0 && t->nodes[node].first_child) {
            *node_out = node;
            *length_out = length;
            return 1;
        }
    }
    return 0;
}

/* A node with children: its ranking with the owner's own child (if any) first, and that
   child (0: none). The ranking can be one longer than `top`. */
static const int32_t *ranked(const Trie *t, int32_t node, const FollowMap *follow,
                             int32_t *buf, int32_t *len_out, int32_t *own_out) {
    const int32_t *top = top_of(t, node);
    int32_t len = t->nodes[node].top_len;
    *len_out = len;
    *own_out = 0;
    if (!follow) return top;
    const FollowSlot *last = follow_find(follow, node);
    if (!last || last->gen != t->nodes[node].gen) return top;  /* none, or an old id */
    int32_t own = child_of(t, node, last->token);
    *own_out = own;
    if (!own || own == top[0]) return top;
    int32_t m = 0;
    buf[m++] = own;
    for (int32_t i = 0; i < len; i++)
        if (top[i] != own) buf[m++] = top[i];
    *len_out = m;
    return buf;
}

static int ensure_scratch(Trie *t, int64_t budget) {
    if (budget <= t->scratch_budget) return 0;
    int64_t n = t->scratch_budget ? t->scratch_budget : 16;
    while (n < budget) n *= 2;
    int64_t heap_entries = 2 * n + 1;
    int64_t ints = (t->max_window + n) + 6 * n + (n + 1) + 4 * (n + 1) + (t->breadth + 1) +
                   (n + 1) * t->breadth + 2 * (n + 1);
    void *block = malloc((size_t)heap_entries * sizeof(HeapEntry) + (size_t)ints * sizeof(int32_t));
    if (!block) return NO_MEMORY;
    free(t->scratch);
    t->scratch = block;
    t->heap = block;
    int32_t *p = (int32_t *)(t->heap + heap_entries);
    t->window = p, p += t->max_window + n;
    t->a_tokens = p, p += n;
    t->a_parents = p, p += n;
    t->b_tokens = p, p += n;
    t->b_parents = p, p += n;
    t->mapped = p, p += n;
    t->child_next = p, p += n;
    t->child_head = p, p += n + 1;
    t->cur_nodes = p, p += n + 1;
    t->cur_index = p, p += n + 1;
    t->next_nodes = p, p += n + 1;
    t->next_index = p, p += n + 1;
    t->ranked_buf = p, p += t->breadth + 1;
    t->kids = p, p += (n + 1) * t->breadth;
    t->depth_of = p, p += n + 1;
    t->depth_start = p;
    t->scratch_budget = n;
    return 0;
}

/* One branch: the chain's tokens (out_tokens), its count returned. */
static int64_t chain(Trie *t, const int32_t *window, int32_t n, int64_t budget, const Stream *s,
                     int32_t *out_tokens, int32_t *match_length) {
    const FollowMap *follow = s && s->with_follow ? &s->follow : NULL;
    MatchIter it;
    int32_t node, length;
    matches_begin(t, &it, window, n, s);
    if (!matches_next(t, &it, &node, match_length)) node = -1, *match_length = 0;
    int64_t count = 0;
    while (node >= 0 && count < budget) {
        if (t->nodes[node].top_len > 0) {
            int32_t len, own;
            node = ranked(t, node, follow, t->ranked_buf, &len, &own)[0];
            out_tokens[count++] = t->nodes[node].token;
        } else {
            /* Stalled (a leaf or the depth limit): re-match on the context extended by the
               chain; a match has children, so the next turn appends. */
            const int32_t *extended = t->window;
            int32_t size = t->max_window;
            if (count >= t->max_window) {
                extended = out_tokens + (count - t->max_window);
            } else {
                int32_t from_window = n < t->max_window - (int32_t)count
                                          ? n : t->max_window - (int32_t)count;
                if (from_window > 0)
                    memcpy(t->window, window + n - from_window, (size_t)from_window * sizeof *window);
                memcpy(t->window + from_window, out_tokens, (size_t)count * sizeof *window);
                size = from_window + (int32_t)count;
            }
            matches_begin(t, &it, extended, size, NULL);
            if (!matches_next(t, &it, &node, &length)) node = -1;
        }
    }
    return count;
}

static int64_t expand_bfs(Trie *t, int32_t match, int32_t match_length, int64_t budget,
                          const FollowMap *follow, int32_t *tokens, int32_t *parents) {
    const int32_t *breadths = t->breadths + (size_t)match_length * (size_t)(t->depth + 1);
    int32_t *cur_nodes = t->cur_nodes, *cur_index = t->cur_index;
    int32_t *next_nodes = t->next_nodes, *next_index = t->next_index;
    int64_t cur = 1, count = 0;
    cur_nodes[0] = match;
    cur_index[0] = -1;
    for (int32_t level = 1; cur > 0 && level <= t->depth; level++) {
        int32_t breadth = breadths[level];
        int64_t next = 0;
        for (int64_t j = 0; j < cur; j++) {
            int32_t len, own;
            const int32_t *children = ranked(t, cur_nodes[j], follow, t->ranked_buf, &len, &own);
            if (len > breadth) len = breadth;
            for (int32_t r = 0; r < len; r++) PREFETCH(&t->nodes[children[r]]);
            for (int32_t r = 0; r < len; r++) {
                int32_t child = children[r];
                tokens[count] = t->nodes[child].token;
                parents[count] = cur_index[j];
                count++;
                if (count == budget) return count;
                if (t->nodes[child].first_child) {
                    next_nodes[next] = child;
                    next_index[next] = (int32_t)count - 1;
                    next++;
                    prefetch_ranking(t, child, follow);
                }
            }
        }
        int32_t *swap = cur_nodes;
        cur_nodes = next_nodes, next_nodes = swap;
        swap = cur_index;
        cur_index = next_index, next_index = swap;
        cur = next;
    }
    return count;
}

static inline int heap_before(const HeapEntry *a, const HeapEntry *b) {
    return a->prob > b->prob || (a->prob == b->prob && a->seq < b->seq);
}

static void heap_push(HeapEntry *heap, int64_t *len, HeapEntry entry) {
    int64_t i = (*len)++;
    while (i > 0) {
        int64_t up = (i - 1) / 2;
        if (!heap_before(&entry, &heap[up])) break;
        heap[i] = heap[up];
        i = up;
    }
    heap[i] = entry;
}

static HeapEntry heap_pop(HeapEntry *heap, int64_t *len) {
    HeapEntry top = heap[0], last = heap[--(*len)];
    int64_t i = 0, n = *len;
    for (;;) {
        int64_t child = 2 * i + 1;
        if (child >= n) break;
        if (child + 1 < n && heap_before(&heap[child + 1], &heap[child])) child++;
        if (!heap_before(&heap[child], &last)) break;
        heap[i] = heap[child];
        i = child;
    }
    if (n > 0) heap[i] = last;
    return top;
}

typedef struct {
    Trie *t;
    const FollowMap *follow;
    int64_t heap_len, seq, kids_used;
} ProbState;

static void push_kid(ProbState *st, int32_t parent, double parent_prob, int32_t kids_off,
                     int32_t kids_len, int32_t own, int32_t rank, int32_t parent_index) {
    const Node *nodes = st->t->nodes;
    int32_t kid = st->t->kids[kids_off + rank];
    HeapEntry e;
    e.prob = kid == own ? parent_prob
                        : parent_prob * (double)nodes[kid].count / (double)nodes[parent].count;
    e.parent_prob = parent_prob;
    e.seq = st->seq++;
    e.kid = kid;
    e.parent = parent;
    e.own = own;
    e.rank = rank;
    e.parent_index = parent_index;
    e.kids_off = kids_off;
    e.kids_len = kids_len;
    heap_push(st->t->heap, &st->heap_len, e);
}

static void push_first_child(ProbState *st, int32_t node, double prob, int32_t index) {
    Trie *t = st->t;
    int32_t len, own;
    const int32_t *kids = ranked(t, node, st->follow, t->ranked_buf, &len, &own);
    if (len > t->breadth) len = t->breadth;
    int32_t off = (int32_t)st->kids_used;
    memcpy(t->kids + off, kids, (size_t)len * sizeof *kids);
    for (int32_t i = 0; i < len; i++) PREFETCH(&t->nodes[kids[i]]);
    st->kids_used += len;
    push_kid(st, node, prob, off, len, own, 0, index);
}

/* The `budget` likeliest nodes by P(path) = prod count(child) / count(parent), in pop order
   (topological). A node's children are ranked, so their probabilities fall with rank: the
   heap holds one entry per node with unpicked children, its next. */
static int64_t expand_prob(Trie *t, int32_t match, int64_t budget, const FollowMap *follow,
                           int32_t *tokens, int32_t *parents) {
    ProbState st = {t, follow, 0, 0, 0};
    int64_t count = 0;
    push_first_child(&st, match, 1.0, -1);
    while (st.heap_len > 0 && count < budget) {
        HeapEntry e = heap_pop(t->heap, &st.heap_len);
        tokens[count] = t->nodes[e.kid].token;
        parents[count] = e.parent_index;
        count++;
        if (e.rank + 1 < e.kids_len)
            push_kid(&st, e.parent, e.parent_prob, e.kids_off, e.kids_len, e.own, e.rank + 1,
                     e.parent_index);
        if (t->nodes[e.kid].top_len > 0) push_first_child(&st, e.kid, e.prob, (int32_t)count - 1);
    }
    return count;
}

/* Add the nodes of another draft tree (topological order) whose paths are not in the tree
   yet, while there is budget. Returns whether any was added. */
static int merge(Trie *t, int64_t *have, const int32_t *more_tokens, const int32_t *more_parents,
                 int64_t more, int64_t budget) {
    int32_t *tokens = t->a_tokens, *parents = t->a_parents;
    int32_t *head = t->child_head, *next = t->child_next;  /* children lists, by parent + 1 */
    for (int64_t i = 0; i <= budget; i++) head[i] = -1;
    for (int64_t i = 0; i < *have; i++) {
        next[i] = head[parents[i] + 1];
        head[parents[i] + 1] = (int32_t)i;
    }
    int added = 0;
    for (int64_t j = 0; j < more; j++) {
        int32_t parent = more_parents[j];
        if (parent >= 0) {
            parent = t->mapped[parent];
            if (parent < 0) {  /* its parent was left out */
                t->mapped[j] = -1;
                continue;
            }
        }
        int32_t index = head[parent + 1];
        while (index >= 0 && tokens[index] != more_tokens[j]) index = next[index];
        if (index < 0 && *have < budget) {
            index = (int32_t)(*have)++;
            tokens[index] = more_tokens[j];
            parents[index] = parent;
            next[index] = head[parent + 1];
            head[parent + 1] = index;
            added = 1;
        }
        t->mapped[j] = index;
    }
    return added;
}

/* A tree in topological order, written out in BFS order (stable within a level). */
static void bfs_order(Trie *t, int64_t n, int32_t *out_tokens, int32_t *out_parents) {
    const int32_t *tokens = t->a_tokens, *parents = t->a_parents;
    int32_t *depth = t->depth_of, *start = t->depth_start, *new_index = t->mapped;
    for (int64_t i = 0; i <= n; i++) start[i] = 0;
    for (int64_t i = 0; i < n; i++) {
        depth[i] = parents[i] < 0 ? 0 : depth[parents[i]] + 1;
        start[depth[i] + 1]++;
    }
    for (int64_t d = 1; d <= n; d++) start[d] += start[d - 1];
    for (int64_t i = 0; i < n; i++) {
        int32_t at = start[depth[i]]++;
        new_index[i] = at;
        out_tokens[at] = tokens[i];
        out_parents[at] = parents[i] < 0 ? -1 : new_index[parents[i]];  /* parents[i] < i */
    }
}

/* Where ngt_propose writes: room for `cap` tokens, then as much for their parents. */
int64_t ngt_set_output(Trie *t, int32_t *out, int64_t cap) {
    if (!out || cap < 0) return BAD_ARGUMENT;
    t->out = out;
    t->out_cap = cap;
    return 0;
}

/* Draft tree after the context (its last `n` tokens; the root is not returned): `count`
   tokens, then their parents right after them in the output buffer, in BFS order;
   parents[i] < i, -1 = the root; count <= budget. mode = (stream slot + 1) * 2 + one_branch
   (slot -1: no owner). Returns count | (the longest matched suffix's length << 32). */
int64_t ngt_propose(Trie *t, const int32_t *context, int32_t n, int32_t budget, int32_t mode) {
    const int32_t one_branch = mode & 1, slot = (mode >> 1) - 1;
    int32_t *out = t->out;
    if (budget <= 0) return 0;
    if (budget > t->out_cap || budget > INT32_MAX / 4 || n < 0 || (n > 0 && !context))
        return BAD_ARGUMENT;
    const Stream *s = NULL;
    if (slot >= 0) {
        s = stream_at(t, slot);
        if (!s) return BAD_ARGUMENT;
    }
    if (n > t->max_window) {
        context += n - t->max_window;
        n = t->max_window;
    }
    if (ensure_scratch(t, budget)) return NO_MEMORY;
    int32_t match_length = 0;
    if (one_branch) {
        int64_t count = chain(t, context, n, budget, s, out, &match_length);
        for (int64_t i = 0; i < count; i++) out[count + i] = (int32_t)i - 1;
        return count | ((int64_t)match_length << 32);
    }
    const FollowMap *follow = s && s->with_follow ? &s->follow : NULL;
    MatchIter it;
    int32_t node, length;
    int64_t have = 0, last_count = 0;
    int reorder = 0;
    matches_begin(t, &it, context, n, s);
    while (matches_next(t, &it, &node, &length)) {
        if (!match_length) match_length = length;  /* the first is the longest */
        /* A shorter suffix seen no more often than the last one expanded has the same
           continuations (each of its occurrences extends one of the longer's), at most one
           level deeper: not worth a second expansion. */
        if (t->nodes[node].count <= last_count) continue;
        last_count = t->nodes[node].count;
        int64_t more = t->prob ? expand_prob(t, node, budget, follow, t->b_tokens, t->b_parents)
                               : expand_bfs(t, node, length, budget, follow, t->b_tokens,
                                            t->b_parents);
        if (have) {
            reorder |= merge(t, &have, t->b_tokens, t->b_parents, more, budget);
        } else {
            memcpy(t->a_tokens, t->b_tokens, (size_t)more * sizeof *t->a_tokens);
            memcpy(t->a_parents, t->b_parents, (size_t)more * sizeof *t->a_parents);
            have = more;
            reorder = t->prob;  /* PROB comes in pop order, not BFS order */
        }
        if (have >= budget) break;
    }
    if (reorder) {
        bfs_order(t, have, out, out + have);
    } else {
        memcpy(out, t->a_tokens, (size_t)have * sizeof *out);
        memcpy(out + have, t->a_parents, (size_t)have * sizeof *out);
    }
    return have | ((int64_t)match_length << 32);
}

/* ngt_propose for a whole batch, in one call (a call per request costs more in Python than
 * the proposal itself). Request b's context is contexts[offsets[b] .. offsets[b + 1]), its
 * budget and mode as ngt_propose's. Row b of the (batch, width) int64 outputs gets its tree
 * with the root first (the context's last token, parent -1), the drafts after it (parents
 * shifted by one) and padding (token 0, parent -1); num_nodes[b] counts the root,
 * match_lengths[b] is the longest suffix with a continuation. Needs width > every budget
 * and an output buffer (ngt_set_output) of the largest budget. */
int64_t ngt_propose_batch(Trie *t, const int32_t *contexts, const int64_t *offsets, int32_t batch,
                          const int32_t *budgets, const int32_t *modes, int32_t width, int64_t *tokens,
                          int64_t *parents, int64_t *num_nodes, int64_t *match_lengths) {
    if (batch < 0 || width < 1) return BAD_ARGUMENT;
    for (int32_t b = 0; b < batch; b++) {
        const int64_t start = offsets[b], n = offsets[b + 1] - start;
        if (n < 1 || n > INT32_MAX || budgets[b] >= width) return BAD_ARGUMENT;
        const int64_t result = ngt_propose(t, contexts + start, (int32_t)n, budgets[b], modes[b]);
        if (result < 0) return result;
        const int64_t count = result & 0xFFFFFFFF;
        int64_t *row_tokens = tokens + (int64_t)b * width, *row_parents = parents + (int64_t)b * width;
        row_tokens[0] = contexts[start + n - 1];
        row_parents[0] = -1;
        for (int64_t i = 0; i < count; i++) {
            row_tokens[1 + i] = t->out[i];
            row_parents[1 + i] = (int64_t)t->out[count + i] + 1;
        }
        for (int64_t i = 1 + count; i < width; i++) {
            row_tokens[i] = 0;
            row_parents[i] = -1;
        }
        num_nodes[b] = 1 + count;
        match_lengths[b] = result >> 32;
    }
    return 0;
}

/* The forecast of the step after a verify step (runner/forecast_step.py's table, whose layout
 * and reasons speculative/ngram/forecast.py gives). Request b's context is contexts[offsets[b]
 * .. offsets[b + 1]), its tree the rows b of tree_tokens / tree_parents ((batch, width) int64,
 * the root first, parents counted from it, tree_counts[b] real nodes) and modes[b] its
 * ngt_propose mode without the branch bit. For each node j (the context then ends with the
 * path from the root to j), the trie's first-level continuations of a tree proposal of
 * span * (candidates + j's children) drafts, j's children left out, the first `candidates`
 * of them, each with the proposal of nodes - 1 drafts after it (a chain with one_branch),
 * go into table[b, j, c] ((batch, width, candidates, 2 * nodes + 1) int64): the token, the
 * drafts, their parents counted from it as node 0, 1 + drafts, the match length capped at
 * key_cap. The table comes in empty (forecast.py's empty_table): entries not found stay so.
 * Needs an output buffer (ngt_set_output) of span * (candidates + width) and nodes - 1. */
int64_t ngt_forecast(Trie *t, const int32_t *contexts, const int64_t *offsets, int32_t batch,
                     const int64_t *tree_tokens, const int64_t *tree_parents, const int64_t *tree_counts,
                     int32_t width, const int32_t *modes, int32_t candidates, int32_t span, int32_t nodes,
                     int32_t one_branch, int32_t key_cap, int64_t *table) {
    if (batch < 0 || width < 1 || candidates < 1 || span < 1 || nodes < 2) return BAD_ARGUMENT;
    if ((int64_t)span * (candidates + width) > t->out_cap || nodes - 1 > t->out_cap) return BAD_ARGUMENT;
    const int64_t fields = 2 * (int64_t)nodes + 1;
    int32_t *buffer = malloc(((size_t)t->max_window + (size_t)width + 1) * sizeof *buffer);
    int32_t *chosen = malloc((size_t)candidates * sizeof *chosen);
    int32_t *path = malloc((size_t)width * sizeof *path);
    if (!buffer || !chosen || !path) {
        free(buffer), free(chosen), free(path);
        return NO_MEMORY;
    }
    int64_t status = 0;
    for (int32_t b = 0; b < batch && status == 0; b++) {
        const int64_t start = offsets[b], n = offsets[b + 1] - start;
        const int64_t *tokens = tree_tokens + (int64_t)b * width, *parents = tree_parents + (int64_t)b * width;
        const int64_t count = tree_counts[b];
        if (n < 1 || count < 1 || count > width) {
            status = BAD_ARGUMENT;
            break;
        }
        const int64_t base = n < t->max_window ? n : t->max_window;
        memcpy(buffer, contexts + start + n - base, (size_t)base * sizeof *buffer);
        for (int64_t j = 0; j < count && status == 0; j++) {
            int32_t depth = 0, children = 0;
            for (int64_t node = j; node > 0; node = parents[node]) {
                if (parents[node] < 0 || parents[node] >= node || depth >= width) {
                    status = BAD_ARGUMENT;
                    break;
                }
                path[depth++] = (int32_t)tokens[node];
            }
            if (status) break;
            for (int32_t d = 0; d < depth; d++) buffer[base + d] = path[depth - 1 - d];   /* root's child first */
            for (int64_t k = 1; k < count; k++) children += parents[k] == j;
            const int32_t length = (int32_t)base + depth;
            int64_t result = ngt_propose(t, buffer, length, span * (candidates + children), modes[b]);
            if (result < 0) {
                status = result;
                break;
            }
            const int64_t found = result & 0xFFFFFFFF;
            int32_t picked = 0;
            for (int64_t i = 0; i < found && picked < candidates; i++) {
                if (t->out[found + i] != -1) continue;   /* first level only */
                int excluded = 0;
                for (int64_t k = 1; k < count && !excluded; k++)
                    excluded = parents[k] == j && tokens[k] == t->out[i];
                if (!excluded) chosen[picked++] = t->out[i];
            }
            for (int32_t c = 0; c < picked; c++) {
                buffer[length] = chosen[c];
                result = ngt_propose(t, buffer, length + 1, nodes - 1, modes[b] | (one_branch ? 1 : 0));
                if (result < 0) {
                    status = result;
                    break;
                }
                const int64_t drafts = result & 0xFFFFFFFF, matched = result >> 32;
                int64_t *entry = table + (((int64_t)b * width + j) * candidates + c) * fields;
                entry[0] = chosen[c];
                for (int64_t i = 0; i < drafts; i++) {
                    entry[1 + i] = t->out[i];
                    entry[nodes + i] = (int64_t)t->out[drafts + i] + 1;
                }
                entry[2 * (int64_t)nodes - 1] = 1 + drafts;
                entry[2 * (int64_t)nodes] = matched < key_cap ? matched : key_cap;
            }
        }
    }
    free(buffer), free(chosen), free(path);
    return status;
}

/* ------------------------------------------------------------------ life cycle */

void ngt_free(Trie *t) {
    if (!t) return;
    for (int64_t i = 0; i < t->num_streams; i++) {
        free(t->streams[i].frontier);
        free(t->streams[i].follow.slots);
    }
    free(t->streams);
    free(t->free_streams);
    free(t->anon.frontier);
    free(t->next_frontier);
    free(t->found);
    free(t->hashes);
    free(t->suffix_nodes);
    free(t->walk_cur);
    free(t->walk_active);
    free(t->breadths);
    free(t->nodes);
    free(t->rows);
    free(t->free_rows);
    free(t->rank_buf);
    free(t->free_ids);
    free(t->queue);
    free(t->batch);
    free(t->table);
    free(t->scratch);
    free(t);
}

/* `breadths`: [(max_window + 1) * (depth + 1)] children expanded per node, by match length
   and level (trie.py computes the table). */
Trie *ngt_create(int64_t capacity, int64_t target, int64_t chunk, int32_t min_window,
                 int32_t max_window, int32_t breadth, int32_t depth, int32_t prob,
                 const int32_t *breadths) {
    /* min_window > max_window is allowed: nothing ever matches */
    if (!breadths || capacity < 1 || chunk < 1 || depth < 2 || breadth < 1 ||
        breadth > INT16_MAX || min_window < 1 || max_window < 0 || max_window > depth - 1)
        return NULL;
    Trie *t = calloc(1, sizeof *t);
    if (!t) return NULL;
    t->capacity = capacity;
    t->target = target;
    t->chunk = chunk;
    t->min_window = min_window;
    t->max_window = max_window;
    t->breadth = breadth;
    t->depth = depth;
    t->prob = prob;
    size_t table_size = (size_t)(max_window + 1) * (size_t)(depth + 1);
    t->breadths = malloc(table_size * sizeof *t->breadths);
    t->node_cap = 64;
    t->nodes = calloc((size_t)t->node_cap, sizeof *t->nodes);
    t->rank_buf = malloc((size_t)breadth * sizeof *t->rank_buf);
    t->free_ids = malloc((size_t)t->node_cap * sizeof *t->free_ids);
    t->queue = malloc((size_t)t->node_cap * sizeof *t->queue);
    t->batch = malloc((size_t)t->node_cap * sizeof *t->batch);
    t->table_mask = 127;
    t->table = calloc((size_t)t->table_mask + 1, sizeof *t->table);
    t->anon.frontier = malloc((size_t)(2 * depth) * sizeof *t->anon.frontier);
    t->next_frontier = malloc((size_t)(depth + 1) * sizeof *t->next_frontier);
    t->found = malloc((size_t)(depth + 1) * sizeof *t->found);
    t->hashes = malloc((size_t)(depth + 1) * sizeof *t->hashes);
    t->suffix_nodes = malloc((size_t)(depth + 1) * sizeof *t->suffix_nodes);
    t->walk_cur = malloc((size_t)(depth + 1) * sizeof *t->walk_cur);
    t->walk_active = malloc((size_t)(depth + 1) * sizeof *t->walk_active);
    if (!t->breadths || !t->nodes || !t->rank_buf || !t->free_ids || !t->queue || !t->batch ||
        !t->table || !t->anon.frontier || !t->next_frontier || !t->found || !t->hashes ||
        !t->suffix_nodes || !t->walk_cur || !t->walk_active) {
        ngt_free(t);
        return NULL;
    }
    memcpy(t->breadths, breadths, table_size * sizeof *t->breadths);
    t->anon.tail = t->anon.frontier + depth;
    t->anon.in_use = 1;
    t->nodes[0].token = -1;
    t->nodes[0].parent = -1;
    t->next_id = 1;
    return t;
}

/* ------------------------------------------------------------------ introspection (tests) */

int64_t ngt_num_nodes(const Trie *t) { return t->num_nodes; }

int64_t ngt_epoch(const Trie *t) { return t->epoch; }

static int valid_node(const Trie *t, int32_t node) {
    return node >= 0 && node < t->next_id && (node == 0 || t->nodes[node].parent >= 0);
}

/* Every live node's (id, token, parent, count, stamp); returns how many there are (writes
   them only when they fit in `cap`). */
int64_t ngt_export(const Trie *t, int32_t *ids, int32_t *tokens, int32_t *parents,
                   int64_t *counts, int64_t *stamps, int64_t cap) {
    if (t->num_nodes > cap) return t->num_nodes;
    int64_t n = 0;
    for (int32_t id = 1; id < t->next_id && n < cap; id++) {
        const Node *node = &t->nodes[id];
        if (node->parent < 0) continue;
        ids[n] = id;
        tokens[n] = node->token;
        parents[n] = node->parent;
        counts[n] = node->count;
        stamps[n] = node->stamp;
        n++;
    }
    return n;
}

/* A node's children (ids and tokens) from its sibling list; returns how many there are
   (writes the first `cap`). */
int64_t ngt_children(const Trie *t, int32_t node, int32_t *ids, int32_t *tokens, int64_t cap) {
    if (!valid_node(t, node)) return BAD_ARGUMENT;
    int64_t n = 0;
    for (int32_t child = t->nodes[node].first_child; child; child = t->nodes[child].next_sibling) {
        if (n < cap) {
            ids[n] = child;
            tokens[n] = t->nodes[child].token;
        }
        if (++n > t->num_nodes) return BAD_ARGUMENT;  /* a cycle */
    }
    return n;
}

/* A child through the hash table: its id, 0 when absent. */
int64_t ngt_child(const Trie *t, int32_t node, int32_t token) {
    if (!valid_node(t, node)) return BAD_ARGUMENT;
    return child_of(t, node, token);
}

int64_t ngt_top(const Trie *t, int32_t node, int32_t *out, int64_t cap) {
    if (!valid_node(t, node) || cap < t->nodes[node].top_len) return BAD_ARGUMENT;
    memcpy(out, top_of(t, node), (size_t)t->nodes[node].top_len * sizeof *out);
    return t->nodes[node].top_len;
}

/* A stream's frontier and tail (each of max_depth entries in `frontier`, `tail`);
   state = [frontier_len, tail_len, epoch]. */
int64_t ngt_stream_state(Trie *t, int32_t slot, int32_t *frontier, int32_t *tail,
                         int64_t *state) {
    const Stream *s = stream_at(t, slot);
    if (!s) return BAD_ARGUMENT;
    memcpy(frontier, s->frontier, (size_t)s->frontier_len * sizeof *frontier);
    memcpy(tail, s->tail, (size_t)s->tail_len * sizeof *tail);
    state[0] = s->frontier_len;
    state[1] = s->tail_len;
    state[2] = s->epoch;
    return 0;
}

/* Every (node, suffix length) that propose would consider, longest first. */
int64_t ngt_matches(Trie *t, const int32_t *window, int64_t n, int32_t slot, int32_t *nodes,
                    int32_t *lengths, int64_t cap) {
    const Stream *s = NULL;
    if (slot >= 0 && !(s = stream_at(t, slot))) return BAD_ARGUMENT;
    if (n > t->max_window || n < 0) return BAD_ARGUMENT;
    MatchIter it;
    int64_t count = 0;
    int32_t node, length;
    matches_begin(t, &it, window, (int32_t)n, s);
    while (count < cap && matches_next(t, &it, &node, &length)) {
        nodes[count] = node;
        lengths[count] = length;
        count++;
    }
    return count;
}

/* Structural self-check: 0 when every invariant holds, else the number of the first broken. */
int64_t ngt_check(const Trie *t) {
    const Node *nodes = t->nodes;
    int64_t code = 0, live = 0, listed = 0;
    unsigned char *seen = calloc((size_t)t->next_id, 1);
    int32_t *rank = malloc((size_t)t->breadth * sizeof *rank);
    if (!seen || !rank) {
        code = NO_MEMORY;
        goto done;
    }
    if (nodes[0].parent != -1 || nodes[0].top_len != 0) { code = 1; goto done; }
    for (int32_t id = 0; id < t->next_id; id++) {
        const Node *node = &nodes[id];
        if (id && node->parent < 0) continue;
        if (id) {
            live++;
            if (!valid_node(t, node->parent)) { code = 2; goto done; }
            if (child_of(t, node->parent, node->token) != id) { code = 3; goto done; }
            if (node->count < 1 || node->stamp > t->clock) { code = 4; goto done; }
        }
        int64_t children = 0;
        for (int32_t child = node->first_child, prev = 0; child; prev = child, child = nodes[child].next_sibling) {
            if (nodes[child].parent != id || nodes[child].prev_sibling != prev) { code = 5; goto done; }
            if (++children > t->num_nodes) { code = 5; goto done; }
        }
        listed += children;
        int32_t expected = id ? rank_children(t, id, rank) : 0;
        if (node->top_len != expected ||
            memcmp(rank, top_of(t, id), (size_t)expected * sizeof *rank)) {
            code = 6;
            goto done;
        }
    }
    if (live != t->num_nodes || listed != t->num_nodes || t->table_used != t->num_nodes) { code = 7; goto done; }
    {   /* every ranking row is used by one node or free, none lost */
        unsigned char *row_seen = calloc((size_t)t->rows_used + 1, 1);
        int64_t rows = t->num_free_rows;
        if (!row_seen) { code = NO_MEMORY; goto done; }
        for (int64_t i = 0; i < t->num_free_rows && !code; i++) {
            int32_t row = t->free_rows[i];
            if (row < 0 || row >= t->rows_used || row_seen[row]++) code = 14;
        }
        for (int32_t id = 1; id < t->next_id && !code; id++) {
            if (nodes[id].parent < 0 || nodes[id].top_len < 2) continue;
            rows++;
            if (nodes[id].top < 0 || nodes[id].top >= t->rows_used || row_seen[nodes[id].top]++) code = 14;
        }
        free(row_seen);
        if (!code && rows != t->rows_used) code = 14;
        if (code) goto done;
    }
    if (live + 1 + t->num_free != t->next_id) { code = 8; goto done; }
    for (int64_t i = 0; i < t->num_free; i++) {
        int32_t id = t->free_ids[i];
        if (id < 1 || id >= t->next_id || nodes[id].parent >= 0 || seen[id]) { code = 8; goto done; }
        seen[id] = 1;
    }
    int64_t slots = 0;
    for (int64_t i = 0; i <= t->table_mask; i++) {
        int32_t child = t->table[i].child;
        if (!child) continue;
        slots++;
        if (child >= t->next_id || nodes[child].parent < 0 || nodes[child].token != t->table[i].token) { code = 9; goto done; }
    }
    if (slots != t->table_used) { code = 9; goto done; }
    if (t->queue_len != t->num_nodes) { code = 10; goto done; }
    for (int64_t i = 0; i < t->queue_len; i++) {
        int32_t id = t->queue[(t->queue_head + i) & (t->node_cap - 1)];
        if (id < 1 || id >= t->next_id || nodes[id].parent < 0 || seen[id]) { code = 10; goto done; }
        seen[id] = 1;
    }
    for (int64_t slot = 0; slot < t->num_streams; slot++) {
        const Stream *s = &t->streams[slot];
        if (!s->in_use) continue;
        if (s->frontier_len != s->tail_len + 1 || s->frontier_len > t->depth || s->frontier[0] != 0) { code = 11; goto done; }
        for (int32_t k = 1; k < s->frontier_len && s->epoch == t->epoch; k++) {
            if (s->frontier[k] >= 0 && s->frontier[k] != walk(t, s->tail + s->tail_len - k, k)) { code = 12; goto done; }
        }
        if (s->with_follow) {
            int64_t used = 0;
            for (int64_t i = 0; i <= s->follow.mask; i++) used += s->follow.slots[i].node != 0;
            if (used != s->follow.used || 2 * used > s->follow.mask + 1) { code = 13; goto done; }
        }
    }
done:
    free(seen);
    free(rank);
    return code;
}
