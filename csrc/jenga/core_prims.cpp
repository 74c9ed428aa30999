// Jenga allocator core: primitive mutations, their undo, derived-set upkeep, invariants.
//
// Every state change of a transaction goes through one prim_* function that logs an undo
// record. Undoing the records in reverse restores the exact state (free-chain order too):
//   take      FREE  -> USED      (pop chain head)      undo: push it back
//   map       page unmapped -> mapped, all FREE       undo: unmapped again
//   unmap     mapped all-FREE page -> unmapped          undo: mapped again, same owner
//   uncache   CACHED -> LIMBO    (leaves LRU and index) undo: re-enter both
//   push_free LIMBO  -> FREE     (push chain head)      undo: pop it
//   use_limbo LIMBO  -> USED                            undo: LIMBO again
// An unmapped page keeps its complete free chain, so mapping it again needs no re-init.
#include <algorithm>
#include <limits>
#include <stdexcept>

#include "jenga/core.hpp"

namespace jvmm::jenga {

int32_t Core::prim_take(int32_t g, int32_t page, int64_t now) {
  Group& G = grp(g);
  Page& P = G.pages[static_cast<size_t>(page)];
  const int32_t b = page * G.blocks_per_page + P.free_head;
  Block& k = G.blocks[static_cast<size_t>(b)];
  P.free_head = k.next_free;
  k.next_free = -1;
  P.num_free -= 1;
  G.num_free_blocks -= 1;
  if (P.num_free == 0) remove_from_free_set(G, page);
  if (logging_) log_undo(UndoKind::kTake, g, b, k.last_access, k.shared);
  k.state = State::kUsed;
  k.refcount = 1;
  k.last_access = now;
  k.shared = false;
  if (!defer_refresh_) refresh_page(g, page);
  return b;
}

int32_t Core::prim_map(int32_t g, int64_t owner, int32_t reused_units) {
  Group& G = grp(g);
  const int32_t B = G.blocks_per_page;
  int32_t page;
  int64_t extended = 0;
  if (!G.free_page_ids.empty()) {
    page = G.free_page_ids.back();
    G.free_page_ids.pop_back();
  } else {
    page = static_cast<int32_t>(G.pages.size());
    G.pages.emplace_back();
    G.blocks.resize(G.blocks.size() + static_cast<size_t>(B));
    Page& fresh = G.pages.back();
    fresh.num_free = B;
    fresh.free_head = 0;
    for (int32_t s = 0; s < B; ++s) {
      G.blocks[static_cast<size_t>(page * B + s)].next_free = (s + 1 < B) ? s + 1 : -1;
    }
    extended = 1;
  }
  Page& P = G.pages[static_cast<size_t>(page)];
  P.mapped = true;
  P.owner = owner;
  G.num_mapped_pages += 1;
  G.num_free_blocks += B;
  free_units_ -= G.units_per_page;  // free-set membership: take_from_page settles it
  if (record_plan_) plan_.push_back({OpKind::kMap, g, page, reused_units});
  if (logging_) log_undo(UndoKind::kMap, g, page, extended, 0);
  return page;
}

void Core::prim_unmap(int32_t g, int32_t page) {
  Group& G = grp(g);
  Page& P = G.pages[static_cast<size_t>(page)];
  set_page_evictable(g, page, false);
  remove_from_free_set(G, page);
  P.mapped = false;
  G.free_page_ids.push_back(page);
  G.num_mapped_pages -= 1;
  G.num_free_blocks -= G.blocks_per_page;
  free_units_ += G.units_per_page;
  if (record_plan_) plan_.push_back({OpKind::kUnmap, g, page, 0});
  if (logging_) log_undo(UndoKind::kUnmap, g, page, P.owner, 0);
}

void Core::prim_uncache(int32_t g, int32_t block) {
  Group& G = grp(g);
  Block& k = G.blocks[static_cast<size_t>(block)];
  if (logging_) {
    log_undo(UndoKind::kUncache, g, block, k.last_access, k.prefix_len).hash = k.hash;
  }
  lru_remove(G, block);
  G.hash_to_block.erase(short_key(k.hash));
  k.hashed = false;
  k.state = State::kLimbo;
  G.pages[static_cast<size_t>(page_of(G, block))].num_cached -= 1;
  G.num_cached_blocks -= 1;
  if (!defer_refresh_) refresh_page(g, page_of(G, block));
}

void Core::prim_push_free(int32_t g, int32_t block) {
  Group& G = grp(g);
  const int32_t page = page_of(G, block);
  Page& P = G.pages[static_cast<size_t>(page)];
  Block& k = G.blocks[static_cast<size_t>(block)];
  k.state = State::kFree;
  k.next_free = P.free_head;
  P.free_head = block - page * G.blocks_per_page;
  P.num_free += 1;
  G.num_free_blocks += 1;
  if (P.num_free == 1 && !defer_free_set_) add_to_free_set(G, page);
  if (logging_) log_undo(UndoKind::kPushFree, g, block, 0, 0);
  if (!defer_refresh_) refresh_page(g, page);
}

void Core::prim_use_limbo(int32_t g, int32_t block, int64_t now) {
  Block& k = grp(g).blocks[static_cast<size_t>(block)];
  if (logging_) log_undo(UndoKind::kUseLimbo, g, block, k.last_access, k.shared);
  k.state = State::kUsed;
  k.refcount = 1;
  k.last_access = now;
  k.shared = false;
}

// Drop one reference; at zero the block becomes CACHED (hashed) or FREE, and a page left
// with only FREE blocks is unmapped.
// `early`: released by allocate() in an early-release group; the last reference decides.
void Core::prim_release(int32_t g, int32_t block, int64_t now, bool early) {
  Group& G = grp(g);
  Block& k = G.blocks[static_cast<size_t>(block)];
  if (logging_) {
    const int64_t flags = (k.early ? 1 : 0) | (k.demoted ? 2 : 0);
    log_undo(UndoKind::kDecRef, g, block, k.last_access, flags);
  }
  k.refcount -= 1;
  if (k.refcount > 0) return;
  const int32_t page = page_of(G, block);
  Page& P = G.pages[static_cast<size_t>(page)];
  k.last_access = now;
  k.early = early;
  k.demoted = early && !k.shared &&
              (rules_.demote_window_releases ||
               !retained(rules_.retention_interval, rules_.retention_reach[static_cast<size_t>(g)],
                         k.prefix_len));
  counters_.blocks_released += 1;
  if (k.hashed) {
    if (logging_) log_undo(UndoKind::kToCached, g, block, 0, 0);
    k.state = State::kCached;
    lru_insert(G, block);
    P.num_cached += 1;
    G.num_cached_blocks += 1;
    if (!defer_refresh_) refresh_page(g, page);
    return;
  }
  k.state = State::kLimbo;
  prim_push_free(g, block);
  if (P.num_free == G.blocks_per_page) {
    prim_unmap(g, page);
    counters_.pages_unmapped += 1;
  }
}

void Core::rollback(size_t undo_mark, size_t plan_mark) {
  logging_ = false;
  defer_refresh_ = true;
  std::vector<std::pair<int32_t, int32_t>> touched;
  while (undo_.size() > undo_mark) {
    const Undo u = undo_.back();
    undo_.pop_back();
    undo_one(u);
    const Group& G = grp(u.group);
    const bool is_page = u.kind == UndoKind::kMap || u.kind == UndoKind::kUnmap;
    touched.push_back({u.group, is_page ? u.id : page_of(G, u.id)});
  }
  defer_refresh_ = false;
  std::sort(touched.begin(), touched.end());
  touched.erase(std::unique(touched.begin(), touched.end()), touched.end());
  for (const auto& [g, page] : touched) {
    if (static_cast<size_t>(page) < grp(g).pages.size()) refresh_page(g, page);
  }
  plan_.resize(plan_mark);
}

namespace {
// A block taken from limbo (kTake, kUseLimbo) returns to it with the access time and
// shared flag its undo entry saved.
void restore_limbo(Block& k, int64_t last_access, int64_t shared) {
  k.state = State::kLimbo;
  k.refcount = 0;
  k.last_access = last_access;
  k.shared = shared != 0;
}
}  // namespace

void Core::undo_one(const Undo& u) {
  Group& G = grp(u.group);
  switch (u.kind) {
    case UndoKind::kTake:  // back to limbo as kUseLimbo's undo does, then on the free list
      restore_limbo(G.blocks[static_cast<size_t>(u.id)], u.a, u.b);
      prim_push_free(u.group, u.id);
      break;
    case UndoKind::kMap:
      undo_map(u);
      break;
    case UndoKind::kUnmap:
      undo_unmap(u);
      break;
    case UndoKind::kUncache:
      undo_uncache(u);
      break;
    case UndoKind::kPushFree:
      undo_push_free(u);
      break;
    case UndoKind::kDecRef: {
      Block& k = G.blocks[static_cast<size_t>(u.id)];
      k.refcount += 1;
      k.state = State::kUsed;
      k.last_access = u.a;
      k.early = (u.b & 1) != 0;
      k.demoted = (u.b & 2) != 0;
      break;
    }
    case UndoKind::kToCached: {
      Block& k = G.blocks[static_cast<size_t>(u.id)];
      lru_remove(G, u.id);
      G.pages[static_cast<size_t>(page_of(G, u.id))].num_cached -= 1;
      G.num_cached_blocks -= 1;
      k.state = State::kLimbo;
      break;
    }
    case UndoKind::kUseLimbo:
      restore_limbo(G.blocks[static_cast<size_t>(u.id)], u.a, u.b);
      break;
  }
}

void Core::undo_map(const Undo& u) {
  Group& G = grp(u.group);
  const int32_t B = G.blocks_per_page;
  Page& P = G.pages[static_cast<size_t>(u.id)];
  remove_from_free_set(G, u.id);
  P.mapped = false;
  P.owner = -1;
  G.num_mapped_pages -= 1;
  G.num_free_blocks -= B;
  free_units_ += G.units_per_page;
  if (u.a != 0) {  // the page was appended: drop it again
    G.pages.pop_back();
    G.blocks.resize(G.blocks.size() - static_cast<size_t>(B));
  } else {
    G.free_page_ids.push_back(u.id);
  }
}

void Core::undo_unmap(const Undo& u) {
  Group& G = grp(u.group);
  Page& P = G.pages[static_cast<size_t>(u.id)];
  G.free_page_ids.pop_back();
  P.mapped = true;
  P.owner = u.a;
  G.num_mapped_pages += 1;
  G.num_free_blocks += G.blocks_per_page;
  free_units_ -= G.units_per_page;
  add_to_free_set(G, u.id);
}

void Core::undo_uncache(const Undo& u) {
  Group& G = grp(u.group);
  Block& k = G.blocks[static_cast<size_t>(u.id)];
  k.state = State::kCached;
  k.hashed = true;
  k.hash = u.hash;
  k.last_access = u.a;
  k.prefix_len = u.b;
  lru_insert(G, u.id);
  G.hash_to_block.insert(short_key(u.hash), u.id);
  G.pages[static_cast<size_t>(page_of(G, u.id))].num_cached += 1;
  G.num_cached_blocks += 1;
}

void Core::undo_push_free(const Undo& u) {
  Group& G = grp(u.group);
  const int32_t page = page_of(G, u.id);
  Page& P = G.pages[static_cast<size_t>(page)];
  Block& k = G.blocks[static_cast<size_t>(u.id)];
  P.free_head = k.next_free;
  k.next_free = -1;
  k.state = State::kLimbo;
  P.num_free -= 1;
  G.num_free_blocks -= 1;
  if (P.num_free == 0) remove_from_free_set(G, page);
}

// ---------------------------------------------------------------------------------------
// LRU heap of cached blocks (lazy deletion by stamps)
// ---------------------------------------------------------------------------------------

bool Core::lru_live(const Group& G, const LruEntry& e) const {
  if (e.block < 0 || static_cast<size_t>(e.block) >= G.blocks.size()) return false;
  const Block& k = G.blocks[static_cast<size_t>(e.block)];
  return k.state == State::kCached && k.lru_stamp == e.stamp;
}

void Core::lru_insert(Group& G, int32_t block) {
  Block& k = G.blocks[static_cast<size_t>(block)];
  k.lru_stamp = ++next_stamp_;
  G.lru.push_back({evict_time(k), evict_tie(k), block, k.lru_stamp});
  std::push_heap(G.lru.begin(), G.lru.end());
}

void Core::lru_remove(Group& G, int32_t block) {
  G.blocks[static_cast<size_t>(block)].lru_stamp = ++next_stamp_;  // its entry goes stale
  const size_t live = static_cast<size_t>(G.num_cached_blocks);
  if (G.lru.size() > 2 * live + 1024) {
    std::vector<LruEntry> kept;
    kept.reserve(live);
    for (const LruEntry& e : G.lru) {
      if (lru_live(G, e)) kept.push_back(e);
    }
    std::make_heap(kept.begin(), kept.end());
    G.lru.swap(kept);
  }
}

int32_t Core::lru_top(Group& G) {
  while (!G.lru.empty() && !lru_live(G, G.lru.front())) {
    std::pop_heap(G.lru.begin(), G.lru.end());
    G.lru.pop_back();
  }
  return G.lru.empty() ? -1 : G.lru.front().block;
}

// A page is evictable (step 3) when mapped, no block is in use and at least one is cached.
void Core::refresh_page(int32_t g, int32_t page) {
  const Group& G = grp(g);
  const Page& P = G.pages[static_cast<size_t>(page)];
  const bool should = P.mapped && P.num_cached > 0 && num_used(G, page) == 0;
  set_page_evictable(g, page, should);
}

void Core::set_page_evictable(int32_t g, int32_t page, bool evictable) {
  Group& G = grp(g);
  Page& P = G.pages[static_cast<size_t>(page)];
  if (!evictable) {
    if (P.in_evictable) {
      evictable_pages_.erase({P.evict_key, P.evict_tie, g, page});
      evictable_page_units_ -= G.units_per_page;
      G.num_evictable_pages -= 1;
      P.in_evictable = false;
    }
    return;
  }
  PageAge age;
  const int32_t B = G.blocks_per_page;
  for (int32_t s = 0; s < B; ++s) {
    const Block& k = G.blocks[static_cast<size_t>(page * B + s)];
    if (k.state == State::kCached) age.add(evict_time(k), evict_tie(k));
  }
  if (P.in_evictable && P.evict_key == age.newest && P.evict_tie == age.tie) return;
  set_page_evictable(g, page, false);
  P.evict_key = age.newest;
  P.evict_tie = age.tie;
  P.in_evictable = true;
  evictable_pages_.insert({age.newest, age.tie, g, page});
  evictable_page_units_ += G.units_per_page;
  G.num_evictable_pages += 1;
}

void Core::remove_from_free_set(Group& G, int32_t page) {
  Page& P = G.pages[static_cast<size_t>(page)];
  if (!P.in_free_set) return;
  G.pages_with_free.erase({P.owner, page});
  P.in_free_set = false;
}

void Core::add_to_free_set(Group& G, int32_t page) {
  Page& P = G.pages[static_cast<size_t>(page)];
  if (P.in_free_set) return;
  G.pages_with_free.insert({P.owner, page});
  P.in_free_set = true;
}

void Core::settle_page(int32_t g, int32_t page) {
  Group& G = grp(g);
  const Page& P = G.pages[static_cast<size_t>(page)];
  if (P.mapped && P.num_free > 0) add_to_free_set(G, page);
  refresh_page(g, page);
}

}  // namespace jvmm::jenga
