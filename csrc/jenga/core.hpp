// Jenga two-level allocator core: per-block bookkeeping on integers.
//
// Rationale: the hot paths of a KV-cache allocator (free lists, request association of
// large pages, LRU order of evictable blocks and pages, the prefix hash index) run once
// per block per step; doing them in C++ behind batched calls keeps them far below the
// cost of a model step. Python owns policies and the per-request view.
//
// Approach:
//   * A pool of `total_units` units. Group g's large page costs U[g] units and holds B[g]
//     blocks; block id = page * B[g] + slot. Page indices are per group, recycled LIFO.
//   * Block states (derived): USED (refcount > 0), CACHED (refcount 0, hashed; evictable),
//     FREE (refcount 0, unhashed; on its page's intrusive free chain). Unmapped pages'
//     blocks have no state.
//
//        page p of group g:  | slot0 | slot1 | ... | slot B-1 |   owner = first request
//        free chain:  page.free_head -> slot -> block.next_free -> ... -> -1
//
//   * Exact, deterministic LRU orders over the blocks' eviction times (below):
//       lru[g] (binary min-heap, lazy deletion): (evict time, -prefix_len, block)   step 5
//       evictable_pages (std::set): (newest evict time, -longest prefix, group, page) step 3
//       pages_with_free[g] (std::set): (owner, page)                                steps 1, 4
//     The block heap is lazy: an entry is live iff its stamp equals its block's stamp and
//     the block is CACHED; removal is a stamp bump (O(1)); releases arrive with a
//     non-decreasing clock, so a push is O(1) in the common case. Stale entries are
//     dropped when they reach the top or when they outnumber live ones (rebuild).
//   * The rules (step orders, frugal retry, early releases, demotion) are described once,
//     in the design note of jenga/allocator.py; they reach the core as one `Rules` value
//     (JENGA_RULES below). Here: an early block's tie is +prefix_len (head first); a demoted
//     block's eviction time is last_access - kDemotedOffset, below every normal block;
//     clock values must lie in (-2^61, 2^61). A page's key takes its newest block.
//   * Block identity: 128 bits (digest.hpp), kept whole in the block. hash_to_block[g] is
//     open addressing (flat_hash.hpp, no node per entry) on a *short* 64-bit key of it
//     (its low word, masked by short_key_bits; fewer bits are a test hook that forces
//     collisions). A short key is never trusted alone: lookup() compares the whole
//     identity of the block it finds and answers -1 on a mismatch (counted in
//     identity_mismatches); commit() leaves a block out of the index when its short key
//     already names another identity (counted in identity_collisions).
//   * allocate() is a transaction: every primitive mutation appends an undo record; on
//     "no room" the records are undone in reverse (LIFO restores the exact state, free
//     chain order included) and the plan is truncated. The frugal retry undoes the
//     groups (not the releases) and runs them again in frugal mode; the proof that it
//     succeeds whenever any assignment does is in core_frugal.cpp.
//
// Limitations: not thread-safe (one allocator per engine thread; the GIL is released
// only so other Python threads run). std::set costs ~O(log n) per evictable block.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "jenga/digest.hpp"
#include "jenga/flat_hash.hpp"

namespace jvmm::jenga {

enum class OpKind : int32_t { kMap = 0, kUnmap = 1 };

struct PlanOp {
  OpKind kind;
  int32_t group;
  int32_t page;
  int32_t reused_units;
};

struct Page {
  int64_t owner = -1;
  int32_t num_free = 0;
  int32_t num_cached = 0;
  int32_t free_head = -1;  // slot index, -1 = none
  bool mapped = false;
  bool in_evictable = false;
  bool in_free_set = false;  // in its group's pages_with_free
  int64_t evict_key = 0;     // newest last_access of its cached blocks while in_evictable
  int64_t evict_tie = 0;     // -(longest prefix_len among the cached blocks of that access)
};

// FREE: on its page's free chain. USED: refcount > 0. CACHED: refcount 0, hashed, in the
// LRU set. LIMBO: between an eviction and its reuse, inside one primitive sequence only.
enum class State : uint8_t { kFree = 0, kUsed = 1, kCached = 2, kLimbo = 3 };

// One cache line per block (64 bytes either way; aligned, a take or release touches one
// line instead of the two an unaligned block straddles).
struct alignas(64) Block {
  State state = State::kFree;
  int32_t refcount = 0;
  int32_t next_free = -1;  // slot index within the page
  bool hashed = false;
  Identity hash;  // the whole identity; the index keys it by its short key
  int64_t last_access = 0;
  int64_t prefix_len = 0;
  uint64_t lru_stamp = 0;  // stamp of its live heap entry while CACHED
  bool early = false;      // last released early (left a window/chunk mid-request)
  bool demoted = false;    // early, and early releases are demoted (lower cache tier)
  bool shared = false;     // served a prefix hit (acquire) since it was last taken
};

// Demoted blocks rank this much older than their last access: below every normal block
// for clocks in (-kClockLimit, kClockLimit).
constexpr int64_t kDemotedOffset = int64_t{1} << 62;
constexpr int64_t kClockLimit = int64_t{1} << 61;

// The time eviction orders read: last access, or far older for a demoted block.
inline int64_t evict_time(const Block& k) {
  return k.demoted ? k.last_access - kDemotedOffset : k.last_access;
}

// Tie-break among equal evict times, smaller first: the longest prefix first (-prefix_len:
// a finished prefix loses its tail before its head, aligned across groups), but the
// shortest first among early blocks (+prefix_len): of the blocks that left a window
// together, the head serves only the shortest prefixes, the last ones still serve hits
// at the request's prompt end with the blocks the request released after them.
inline int64_t evict_tie(const Block& k) { return k.early ? k.prefix_len : -k.prefix_len; }

// Retention (rules retention_interval, retention_reach): whether a hit at a retention
// boundary reads a block of a group with that reach whose prefix is prefix_len tokens (the
// boundary is the first multiple of interval at or after prefix_len). True when the rule
// is off (interval 0) or the group is not thinned (reach < 0).
inline bool retained(int64_t interval, int64_t reach, int64_t prefix_len) {
  if (interval <= 0 || reach < 0) return true;
  const int64_t below = ((prefix_len % interval) + interval) % interval;  // p mod interval
  const int64_t to_boundary = below == 0 ? 0 : interval - below;
  return to_boundary < reach;
}

struct LruEntry {
  int64_t last_access;  // evict_time() of the block when pushed
  int64_t tie;          // evict_tie() of the block when pushed
  int32_t block;
  uint64_t stamp;
  // min-heap through std::push_heap's max-heap: "a < b" means a is evicted later
  bool operator<(const LruEntry& o) const {
    if (last_access != o.last_access) return last_access > o.last_access;
    if (tie != o.tie) return tie > o.tie;
    return block > o.block;
  }
};

// Step 3 order: newest evict time (LRU), then the smallest evict_tie among the blocks of that
// time (normal blocks: the longest prefix first, aligned eviction: among pages last touched
// together, the tail of a prefix goes before its head, in every group), then group and
// page. Key: (newest evict time, tie, group, page).
using PageKey = std::tuple<int64_t, int64_t, int32_t, int32_t>;

// The page's step-3 key parts from its cached blocks, folded one block at a time.
struct PageAge {
  int64_t newest = std::numeric_limits<int64_t>::min();
  int64_t tie = 0;
  void add(int64_t time, int64_t block_tie) {
    if (time > newest) {
      newest = time;
      tie = block_tie;
    } else if (time == newest) {
      tie = std::min(tie, block_tie);
    }
  }
};

struct Group {
  int32_t blocks_per_page = 1;
  int32_t units_per_page = 1;
  // block / blocks_per_page == (block * page_magic) >> page_shift for 0 <= block < 2^31:
  // page_magic = ceil(2^(32 + l) / B), l = ceil(log2 B) (Granlund-Montgomery, N = 32).
  uint64_t page_magic = uint64_t{1} << 32;
  int32_t page_shift = 32;
  std::vector<Page> pages;
  std::vector<Block> blocks;
  std::vector<int32_t> free_page_ids;  // unmapped page indices below pages.size(), LIFO
  std::set<std::pair<int64_t, int32_t>> pages_with_free;
  std::vector<LruEntry> lru;  // heap of CACHED blocks (plus stale entries)
  FlatHashMap hash_to_block;
  int64_t num_mapped_pages = 0;
  int64_t num_cached_blocks = 0;
  int64_t num_free_blocks = 0;  // FREE blocks in mapped pages
  int64_t num_evictable_pages = 0;
};

// Order of the five allocation steps (jenga/config.py `AllocationOrder`, same names).
enum class AllocationOrder : int32_t { kPaper = 0, kCompact = 1, kPinned = 2 };

// The rules the core allocates and evicts by, as one value: given at construction or
// replaced whole by set_rules(). X(type, name, default, doc) per rule; the struct and its
// Python binding (`jenga._core.Rules`, read-only fields, keyword constructor) are both
// generated from this list, and jenga/config.py `AllocationRules` carries the same fields
// by name (early_release_groups excepted: the allocator derives it from the policies).
// Adding a rule: one line here, one field there, its effect in the core as a step function
// placed by Core::build_order (core_steps.cpp), and the same step in the twin model
// (tests/jenga/core_model.py; tests/jenga/test_core_twin.py lists every rule by name).
#define JENGA_RULES(X)                                                                    \
  X(AllocationOrder, order, AllocationOrder::kPaper,                                      \
    "step order: PAPER 1, 2, 3, 4, 5; COMPACT 1, 4, 2, 3, 5; PINNED 1, 4, 2, then 5 on "  \
    "pages not wholly evictable, 3, 5")                                                   \
  X(bool, frugal_retry, true, "retry a refused allocate() in frugal order")               \
  X(bool, demote_window_releases, false,                                                  \
    "early releases are cached in a lower tier, evicted before every block cached by "    \
    "release(), unless they served a prefix hit")                                         \
  X(bool, reuse_window_releases, false,                                                   \
    "with demote_window_releases, while under 1/4 of the pool is free: right after step " \
    "4, a group reuses its own demoted (window-released) cached blocks on pages it pins " \
    "before mapping or evicting a page (counted as 5)")                                   \
  X(bool, pinned_lru_fair, false,                                                         \
    "with PINNED order, the pinned step takes its block only when no wholly evictable "   \
    "page is less recently used (else step 3 evicts that page first)")                    \
  X(bool, pack_window_blocks, false,                                                      \
    "a call's last window_blocks[g] blocks (those the request keeps) first take a "       \
    "demoted cached block on the pinned page with the most used blocks, then steps 1, "   \
    "4, 2, 5p, 3, 5; the blocks before them (released right after) keep the order")       \
  X(std::vector<int32_t>, window_blocks, {},                                              \
    "one count per group (empty: none): blocks a request keeps once its window passed "   \
    "(0: the group does not release early)")                                              \
  X(std::vector<bool>, early_release_groups, {},                                          \
    "one flag per group (empty: none): blocks cached by allocate()'s release lists of a " \
    "flagged group are early (ties: shortest prefix first)")                              \
  X(int64_t, retention_interval, 0,                                                       \
    "positive: retention boundaries every this many tokens; an early block of a group "   \
    "with a retention reach is demoted unless a hit at the next boundary at or after "    \
    "its prefix reads it, or it served a prefix hit (0: off)")                            \
  X(std::vector<int64_t>, retention_reach, {},                                            \
    "one per group (empty: none): a block is read by a hit at boundary R iff its prefix " \
    "length p has R - reach < p <= R (-1: the group is not thinned)")

struct Rules {
#define JENGA_RULE_FIELD(type, name, init, doc) type name = init;
  JENGA_RULES(JENGA_RULE_FIELD)
#undef JENGA_RULE_FIELD
};

// Steps of the paper's allocation (1-based indices into step counters).
enum Step : int { kOwnFree = 1, kNewPage = 2, kEvictPage = 3, kAnyFree = 4, kEvictBlock = 5 };
// Window-release reuse (reuse_window_releases) takes a group's own demoted blocks only
// while less than 1/kReusePressure of the pool is free.
constexpr int64_t kReusePressure = 4;

struct Counters {
  std::array<int64_t, 6> step_blocks{};  // blocks served by each step (index 1..5)
  int64_t pages_mapped = 0;
  int64_t pages_unmapped = 0;
  int64_t pages_evicted = 0;
  int64_t blocks_evicted = 0;  // cached blocks dropped (by steps 3 and 5)
  int64_t remapped_units = 0;
  int64_t alloc_calls = 0;
  int64_t alloc_failures = 0;
  int64_t frugal_retries = 0;  // failed paper-order passes retried in frugal mode
  int64_t blocks_released = 0;
  int64_t blocks_acquired = 0;  // prefix hits
  int64_t hashes_committed = 0;
  int64_t identity_collisions = 0;  // commits left out: the short key names another identity
  int64_t identity_mismatches = 0;  // lookups refused: short key found, identity differs
};

class Core {
 public:
  Core(const std::vector<int32_t>& blocks_per_page, const std::vector<int32_t>& units_per_page,
       int64_t total_units, const Rules& rules = Rules{}, int32_t short_key_bits = 64,
       bool record_plan = true);

  // Held by the bindings across every public call (after the GIL is released), so threads
  // sharing one Core never interleave inside its tables. The core itself never locks it.
  std::mutex& api_mutex() const { return api_mutex_; }

  // All-or-nothing: first drop one reference per block in releases[g] (blocks the owner no
  // longer needs), then allocate counts[g] new blocks for `owner` in every group g. Returns
  // the block ids per group, or nullopt with every change (releases too) undone.
  std::optional<std::vector<std::vector<int32_t>>> allocate(
      int64_t owner, const std::vector<int32_t>& counts, int64_t now,
      const std::vector<std::vector<int32_t>>& releases);
  // allocate() of n blocks in group g alone (the other groups none, nothing released),
  // without per-call containers: out is cleared, then receives the ids. False: no room,
  // nothing changed (out empty). Throws std::invalid_argument on a bad group or n < 0.
  bool allocate_one(int32_t g, int64_t owner, int32_t n, int64_t now, std::vector<int32_t>& out);
  // Drop one reference per listed block, last listed first; blocks reaching 0 become CACHED
  // (hashed) or FREE, and pages left all FREE are unmapped.
  // Throws std::invalid_argument (nothing changed) if a block is not USED.
  void release(int32_t group, const std::vector<int32_t>& blocks, int64_t now);
  void release(int32_t group, const int32_t* blocks, size_t n, int64_t now);
  // Evict whole evictable pages (step 3's order: LRU by newest access, ties as there) until
  // at least `units` units were freed or none is left; their cached blocks leave the index
  // and the pages are unmapped (plan ops). Returns the units freed. All or nothing: a
  // failure midway rolls every eviction back. Throws std::invalid_argument if units < 0.
  int64_t evict_cached_pages(int64_t units);
  // Drop `blocks` of group g from the prefix cache (their data is known bad): a CACHED one
  // becomes FREE (its page unmapped when left with only FREE blocks: a plan op), a USED one
  // loses its hash and turns FREE instead of CACHED at its last release; an unhashed one is
  // left as it is. Returns the blocks that left the index. Throws std::out_of_range (nothing
  // changed) for an id outside the group.
  int64_t uncache_blocks(int32_t g, const std::vector<int32_t>& blocks);
  // Grow or shrink the pool to `units` units (> 0). A shrink takes free units only: it
  // throws std::invalid_argument (nothing changed) when fewer than `total - units` are
  // free; the caller evicts cached pages first (evict_cached_pages).
  void set_total_units(int64_t units);
  // Take one reference per listed block (a prefix hit). Blocks must be USED or CACHED.
  void acquire(int32_t group, const std::vector<int32_t>& blocks, int64_t now);
  // Enter hashes of USED blocks; a hash already indexed is skipped. Returns entries added.
  // A block whose short key already names another identity is left out (counted).
  int64_t commit(int32_t group, const std::vector<int32_t>& blocks,
                 const std::vector<Identity>& hashes, const std::vector<int64_t>& prefix_lens);
  // Same, for a run of consecutive blocks: prefix_len of blocks[i] = first_prefix + i * step;
  // entries < 0 (blocks the request released) are skipped.
  int64_t commit_run(int32_t group, const std::vector<int32_t>& blocks, const Identity* hashes,
                     int64_t first_prefix, int64_t step);
  // Block id per identity, or -1 (out[i] for hashes[i], n entries); a block found by the
  // short key whose whole identity differs is -1 (counted in identity_mismatches).
  void lookup(int32_t group, const Identity* hashes, size_t n, int32_t* out);
  // The index key of an identity.
  uint64_t short_key(const Identity& id) const { return id.lo & short_key_mask_; }
  int32_t short_key_bits() const { return short_key_bits_; }
  // The plan ops emitted since the last drain (none are kept when record_plan is false:
  // nothing maps pages, e.g. an engine that owns its KV tensors whole).
  std::vector<PlanOp> drain_plan();
  bool record_plan() const { return record_plan_; }
  size_t num_plan_ops() const { return plan_.size(); }

  // Replace the rules whole. An empty early_release_groups means none; otherwise it needs
  // one flag per group (std::invalid_argument, nothing changed). rules() has one per group.
  void set_rules(const Rules& rules);
  const Rules& rules() const { return rules_; }

  // Introspection for tests and stats.
  int64_t total_units() const { return total_units_; }
  int64_t free_units() const { return free_units_; }
  int64_t evictable_page_units() const { return evictable_page_units_; }
  const Counters& counters() const { return counters_; }
  int32_t num_groups() const { return static_cast<int32_t>(groups_.size()); }
  const Group& group(int32_t g) const;
  std::vector<int32_t> eviction_order(int32_t group) const;
  std::vector<std::pair<int32_t, int32_t>> page_eviction_order() const;
  // Throws std::logic_error naming the first disagreement.
  void check_invariants(bool expensive) const;
  // Bytes the core holds: itself and its containers' capacities (std::set nodes counted
  // as their payload plus a 32-byte node header; allocator slack not counted).
  int64_t memory_bytes() const;

 private:
  enum class UndoKind : uint8_t {
    kTake,
    kMap,
    kUnmap,
    kUncache,
    kPushFree,
    kUseLimbo,
    kDecRef,
    kToCached
  };
  struct Undo {
    UndoKind kind;
    int32_t group;
    int32_t id;  // block or page
    int64_t a;   // saved value (owner, last_access, extended flag)
    int64_t b;   // saved prefix_len (uncache), early | demoted << 1 (decref), shared (take)
    Identity hash;
  };

  // Append an undo record in place (a record built on the stack and copied costs a
  // store-forwarding stall per primitive); returns it (hash zero).
  Undo& log_undo(UndoKind kind, int32_t g, int32_t id, int64_t a, int64_t b) {
    Undo& u = undo_.emplace_back();
    u.kind = kind;
    u.group = g;
    u.id = id;
    u.a = a;
    u.b = b;
    return u;
  }

  Group& grp(int32_t g) { return groups_[static_cast<size_t>(g)]; }
  // block / blocks_per_page by a multiply and a shift (a division per primitive was the
  // largest single cost of a release): exact for 0 <= block < 2^31 (set in the constructor).
  int32_t page_of(const Group& G, int32_t block) const {
    return static_cast<int32_t>(
        (static_cast<uint64_t>(static_cast<uint32_t>(block)) * G.page_magic) >> G.page_shift);
  }
  int32_t num_used(const Group& G, int32_t page) const;

  // The allocation steps (core_steps.cpp). Each serves some of the call's blocks and
  // returns true, or returns false with nothing changed; one function per step and rule.
  struct StepCall {
    int32_t g;
    int64_t owner;
    int32_t n;  // blocks still to take
    int64_t now;
    Counters& c;
    std::vector<int32_t>& out;
  };
  using StepFn = bool (Core::*)(StepCall&);
  // The steps a group tries, first to last, until one serves; built once per rules value.
  struct StepOrder {
    std::array<StepFn, 8> steps{};
    size_t size = 0;
    void push(StepFn step) { steps.at(size++) = step; }  // built once per rules value
  };
  static StepOrder build_order(const Rules& rules);
  static StepOrder build_frugal_order();
  bool try_step(const StepOrder& order, StepCall& s);
  bool step_own_free(StepCall& s);               // 1: a page of the owner with a free block
  bool step_own_free_unpinned(StepCall& s);      // 1, frugal: not on wholly evictable pages
  bool step_new_page(StepCall& s);               // 2: map a page from free units
  bool step_new_page_spare(StepCall& s);         // 2, frugal: while the units are spare
  bool step_evict_pages(StepCall& s);            // 3: evict whole pages, map one
  bool step_evict_pages_spare(StepCall& s);      // 3, frugal: while the units are spare
  bool step_any_free(StepCall& s);               // 4: any page of the group with a free block
  bool step_any_free_unpinned(StepCall& s);      // 4, frugal: not on wholly evictable pages
  bool step_evict_block(StepCall& s);            // 5: the LRU cached block
  bool step_evict_pinned(StepCall& s);           // 5 on pages not wholly evictable (PINNED)
  bool step_evict_pinned_lru_fair(StepCall& s);  // the same, after older evictable pages
  bool step_reuse_demoted(StepCall& s);          // 5 on own demoted blocks of pinned pages
  bool step_pack(StepCall& s);                   // 5 on the densest pinned page's demoted block
  int32_t densest_demoted(const Group& G) const;
  static StepOrder build_pack_order(const Rules& rules);
  // The tails of the steps: take from a page (counted as `step`), reuse a cached block.
  bool serve_from_page(StepCall& s, int32_t page, int step);
  bool serve_cached_block(StepCall& s, int32_t block);

  bool allocate_groups(const StepOrder& order, int64_t owner, const std::vector<int32_t>& counts,
                       int64_t now, Counters& c, std::vector<std::vector<int32_t>>& out);
  bool allocate_group(const StepOrder& order, StepCall& s);
  void validate_allocate(const std::vector<int32_t>& counts,
                         const std::vector<std::vector<int32_t>>& releases, int64_t now);
  // A refused allocation: every change undone, counted (c: the failed passes' counters).
  void refuse(size_t plan_mark, const Counters& saved, const Counters& c);
  void add_counters(const Counters& c);
  // Frugal mode (core_frugal.cpp): pages wholly evictable are kept for step 3.
  bool may_fit_frugally(const std::vector<int32_t>& counts) const;
  // Free or cached blocks of g on pages that are not wholly evictable (cost no units).
  int64_t costless_blocks(const Group& G) const;
  // Units group g must take at least for n more blocks: pages beyond its costless blocks.
  int64_t min_units(const Group& G, int64_t n) const;
  void set_frugal_reserve(const std::vector<int32_t>& counts);
  bool spare_units_for(int32_t g, int32_t n) const;
  int32_t frugal_own_free_page(const Group& G, int64_t owner) const;
  int32_t frugal_any_free_page(const Group& G) const;
  int32_t frugal_lru_top(Group& G);
  void restore_lru_aside(Group& G);
  int32_t take_from_page(int32_t g, int32_t page, int32_t n, int64_t now,
                         std::vector<int32_t>& out);
  bool evict_pages_for(int32_t g, Counters& c, int32_t& reused_units);
  // Evict the head of evictable_pages_ (step 3's order), counted in c.
  void evict_lru_page(Counters& c);
  bool allocate_into(int64_t owner, const std::vector<int32_t>& counts, int64_t now,
                     const std::vector<std::vector<int32_t>>& releases,
                     std::vector<std::vector<int32_t>>& out);
  void evict_page(int32_t g, int32_t page);
  // Enter block's identity in G's index; false (nothing changed) when its short key is
  // taken, counting a collision when another identity holds it.
  bool index_block(Group& G, int32_t block, const Identity& id);

  // Primitive mutations, each logged for undo when a transaction is open.
  int32_t prim_take(int32_t g, int32_t page, int64_t now);
  int32_t prim_map(int32_t g, int64_t owner, int32_t reused_units);
  void prim_unmap(int32_t g, int32_t page);
  void prim_uncache(int32_t g, int32_t block);
  void prim_push_free(int32_t g, int32_t block);
  void prim_use_limbo(int32_t g, int32_t block, int64_t now);
  void prim_release(int32_t g, int32_t block, int64_t now, bool early);
  void validate_release(int32_t g, const int32_t* blocks, size_t n);
  void rollback(size_t undo_mark, size_t plan_mark);
  void undo_one(const Undo& u);
  void undo_map(const Undo& u);
  void undo_unmap(const Undo& u);
  void undo_uncache(const Undo& u);
  void undo_push_free(const Undo& u);

  void lru_insert(Group& G, int32_t block);
  void lru_remove(Group& G, int32_t block);
  int32_t lru_top(Group& G);
  bool lru_live(const Group& G, const LruEntry& e) const;
  void refresh_page(int32_t g, int32_t page);
  void set_page_evictable(int32_t g, int32_t page, bool evictable);
  void remove_from_free_set(Group& G, int32_t page);
  void add_to_free_set(Group& G, int32_t page);
  // A page after a run of takes / releases: in the free set iff mapped with a free block,
  // evictable key refreshed.
  void settle_page(int32_t g, int32_t page);
  // True when allocating counts (no releases) cannot fail: every group's shortfall
  // beyond its free blocks fits in free units as new pages (no step can then refuse).
  bool surely_fits(const std::vector<int32_t>& counts) const;

  struct PageTally {
    int64_t mapped = 0, cached = 0, free_blocks = 0, evictable = 0;
  };
  void check_group(int32_t g, bool expensive) const;
  std::vector<char> check_lru(const Group& G, const std::string& where) const;
  void check_page(int32_t g, int32_t p, const std::vector<char>& in_lru, PageTally& tally) const;

  std::vector<Group> groups_;
  int64_t total_units_;
  int64_t free_units_;
  int64_t evictable_page_units_ = 0;
  std::set<PageKey> evictable_pages_;
  std::vector<PlanOp> plan_;
  uint64_t next_stamp_ = 0;
  std::vector<Undo> undo_;
  bool logging_ = false;
  bool record_plan_ = true;
  std::vector<int32_t> one_counts_;            // allocate_one: reused per call
  std::vector<std::vector<int32_t>> one_out_;  // allocate_one: reused per call
  bool defer_refresh_ = false;
  bool defer_free_set_ = false;  // release(): free-set membership settled once per run
  Rules rules_;
  StepOrder order_;                                      // built by set_rules()
  StepOrder pack_order_;                                 // pack_window_blocks' kept blocks
  const StepOrder frugal_order_ = build_frugal_order();  // the frugal retry's order
  std::vector<LruEntry> lru_aside_;      // frugal step 5: entries on evictable pages, set aside
  std::vector<int64_t> frugal_reserve_;  // frugal: units the groups after g need at least
  Counters counters_;
  int32_t short_key_bits_ = 64;
  uint64_t short_key_mask_ = ~uint64_t{0};
  mutable std::mutex api_mutex_;
};

}  // namespace jvmm::jenga
