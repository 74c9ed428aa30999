// Jenga allocator core: the allocation steps, one function per step and rule.
//
// Rationale: a new allocation rule is a new step (or a variant of one) placed in the step
// order, never a branch inside the others; the order a rules value implies is built once,
// when the rules are set, and allocate_group runs it.
//
// Approach: a group's allocation tries the steps of its order first to last until one
// serves blocks, and starts over until its n blocks are served (or none serves: refused):
//   PAPER    1, 2, 3, 4, 5          COMPACT 1, 4, 2, 3, 5
//   PINNED   1, 4, 2, 5p, 3, 5      5p: step 5 on pages not wholly evictable (pinned),
//                                   pinned_lru_fair: 5p yields to an older evictable page
//   pack_window_blocks: a call's last window_blocks[g] blocks (those the request keeps) in
//                          their own order P, 1, 4, 2, 5p, 3, 5 (P: a demoted block of the
//                          pinned page with the most used blocks; counted as 5)
//   reuse_window_releases: 9 right after step 4 (own demoted blocks on pinned pages,
//                          under pressure; counted as 5)
//   frugal retry (any rules): 1u, 2s, 3s, 4u, 5p, 2, 3  (u: not on wholly evictable
//                          pages, s: while the units are spare; core_frugal.cpp)
// Steps 5p and 9 set aside the heap entries of wholly evictable pages they pass over;
// allocate_group puts them back when the group is served or refused.
//
// Limitations: a step order holds at most 8 steps (StepOrder).
#include <algorithm>
#include <limits>
#include <vector>

#include "jenga/core.hpp"

namespace jvmm::jenga {

Core::StepOrder Core::build_order(const Rules& rules) {
  const StepFn own = &Core::step_own_free, any = &Core::step_any_free;
  const StepFn fresh = &Core::step_new_page, pages = &Core::step_evict_pages;
  const StepFn block = &Core::step_evict_block;
  const StepFn pinned =
      rules.pinned_lru_fair ? &Core::step_evict_pinned_lru_fair : &Core::step_evict_pinned;
  std::vector<StepFn> steps;
  switch (rules.order) {
    case AllocationOrder::kCompact:
      steps = {own, any, fresh, pages, block};
      break;
    case AllocationOrder::kPinned:
      steps = {own, any, fresh, pinned, pages, block};
      break;
    default:
      steps = {own, fresh, pages, any, block};
  }
  if (rules.reuse_window_releases) {  // right after step 4
    steps.insert(std::find(steps.begin(), steps.end(), any) + 1, &Core::step_reuse_demoted);
  }
  StepOrder o;
  for (const StepFn step : steps) o.push(step);
  return o;
}

Core::StepOrder Core::build_pack_order(const Rules& rules) {
  const StepFn pinned =
      rules.pinned_lru_fair ? &Core::step_evict_pinned_lru_fair : &Core::step_evict_pinned;
  StepOrder o;
  for (const StepFn step :
       {&Core::step_pack, &Core::step_own_free, &Core::step_any_free, &Core::step_new_page, pinned,
        &Core::step_evict_pages, &Core::step_evict_block}) {
    o.push(step);
  }
  return o;
}

Core::StepOrder Core::build_frugal_order() {
  StepOrder o;
  for (const StepFn step :
       {&Core::step_own_free_unpinned, &Core::step_new_page_spare, &Core::step_evict_pages_spare,
        &Core::step_any_free_unpinned, &Core::step_evict_pinned, &Core::step_new_page,
        &Core::step_evict_pages}) {
    o.push(step);
  }
  return o;
}

bool Core::allocate_group(const StepOrder& order, StepCall& s) {
  bool ok = true;
  while (ok && s.n > 0) ok = try_step(order, s);
  if (!lru_aside_.empty()) restore_lru_aside(grp(s.g));
  return ok;
}

bool Core::try_step(const StepOrder& order, StepCall& s) {
  for (size_t i = 0; i < order.size; ++i) {
    if ((this->*order.steps[i])(s)) return true;
  }
  return false;
}

bool Core::serve_from_page(StepCall& s, int32_t page, int step) {
  const int32_t taken = take_from_page(s.g, page, s.n, s.now, s.out);
  s.n -= taken;
  s.c.step_blocks[static_cast<size_t>(step)] += taken;
  return true;
}

bool Core::serve_cached_block(StepCall& s, int32_t block) {
  prim_uncache(s.g, block);
  prim_use_limbo(s.g, block, s.now);
  s.out.push_back(block);
  s.n -= 1;
  s.c.step_blocks[kEvictBlock] += 1;
  s.c.blocks_evicted += 1;
  return true;
}

bool Core::step_own_free(StepCall& s) {
  const Group& G = grp(s.g);
  auto it = G.pages_with_free.lower_bound({s.owner, std::numeric_limits<int32_t>::min()});
  if (it == G.pages_with_free.end() || it->first != s.owner) return false;
  return serve_from_page(s, it->second, kOwnFree);
}

bool Core::step_own_free_unpinned(StepCall& s) {
  const int32_t page = frugal_own_free_page(grp(s.g), s.owner);
  return page >= 0 && serve_from_page(s, page, kOwnFree);
}

bool Core::step_new_page(StepCall& s) {
  if (free_units_ < grp(s.g).units_per_page) return false;
  const int32_t page = prim_map(s.g, s.owner, 0);
  s.c.pages_mapped += 1;
  return serve_from_page(s, page, kNewPage);
}

bool Core::step_new_page_spare(StepCall& s) {
  return spare_units_for(s.g, s.n) && step_new_page(s);
}

bool Core::step_evict_pages(StepCall& s) {
  int32_t reused = 0;
  if (!evict_pages_for(s.g, s.c, reused)) return false;
  const int32_t page = prim_map(s.g, s.owner, reused);
  s.c.pages_mapped += 1;
  s.c.remapped_units += reused;
  return serve_from_page(s, page, kEvictPage);
}

bool Core::step_evict_pages_spare(StepCall& s) {
  return spare_units_for(s.g, s.n) && step_evict_pages(s);
}

bool Core::step_any_free(StepCall& s) {
  const Group& G = grp(s.g);
  return !G.pages_with_free.empty() &&
         serve_from_page(s, G.pages_with_free.begin()->second, kAnyFree);
}

bool Core::step_any_free_unpinned(StepCall& s) {
  const int32_t page = frugal_any_free_page(grp(s.g));
  return page >= 0 && serve_from_page(s, page, kAnyFree);
}

bool Core::step_evict_block(StepCall& s) {
  const int32_t block = lru_top(grp(s.g));
  return block >= 0 && serve_cached_block(s, block);
}

bool Core::step_evict_pinned(StepCall& s) {
  const int32_t block = frugal_lru_top(grp(s.g));
  return block >= 0 && serve_cached_block(s, block);
}

bool Core::step_evict_pinned_lru_fair(StepCall& s) {
  Group& G = grp(s.g);
  const int32_t block = frugal_lru_top(G);
  if (block < 0) return false;
  if (!evictable_pages_.empty() &&
      std::get<0>(*evictable_pages_.begin()) < G.lru.front().last_access)
    return false;  // an older whole page goes first (step 3)
  return serve_cached_block(s, block);
}

bool Core::step_reuse_demoted(StepCall& s) {
  // reuse only under pressure: below 1/4 of the pool free (plenty: keep caching)
  if (free_units_ * kReusePressure >= total_units_) return false;
  Group& G = grp(s.g);
  const int32_t block = frugal_lru_top(G);
  if (block < 0 || !G.blocks[static_cast<size_t>(block)].demoted) return false;
  return serve_cached_block(s, block);
}

bool Core::step_pack(StepCall& s) {
  const int32_t block = densest_demoted(grp(s.g));
  return block >= 0 && serve_cached_block(s, block);
}

// The demoted cached block on the pinned page (mapped, not wholly evictable) with the most
// used blocks; ties: the least recently used block, then the lowest id. -1 if none.
int32_t Core::densest_demoted(const Group& G) const {
  const int32_t B = G.blocks_per_page;
  int32_t best = -1, best_used = -1;
  int64_t best_time = 0;
  for (size_t p = 0; p < G.pages.size(); ++p) {
    const Page& P = G.pages[p];
    if (!P.mapped || P.in_evictable || P.num_cached == 0) continue;
    const int32_t used = B - P.num_free - P.num_cached;
    if (used < best_used) continue;
    for (int32_t j = 0; j < B; ++j) {
      const int32_t b = static_cast<int32_t>(p) * B + j;
      const Block& k = G.blocks[static_cast<size_t>(b)];
      if (k.state != State::kCached || !k.demoted) continue;
      if (used > best_used || k.last_access < best_time) {
        best = b;
        best_used = used;
        best_time = k.last_access;
      }
    }
  }
  return best;
}

int32_t Core::take_from_page(int32_t g, int32_t page, int32_t n, int64_t now,
                             std::vector<int32_t>& out) {
  Group& G = grp(g);
  Page& P = G.pages[static_cast<size_t>(page)];
  const int32_t k = std::min(n, P.num_free);
  const bool deferred = defer_refresh_;  // one page: its evictable key once, at the end
  defer_refresh_ = true;
  if (logging_) {
    for (int32_t i = 0; i < k; ++i) out.push_back(prim_take(g, page, now));
  } else {  // prim_take's work inline, the chain walked with the arrays hoisted
    Block* const all = G.blocks.data();
    const int32_t base = page * G.blocks_per_page;
    int32_t head = P.free_head;
    for (int32_t i = 0; i < k; ++i) {
      const int32_t b = base + head;
      Block& blk = all[b];
      head = blk.next_free;
      blk.next_free = -1;
      blk.state = State::kUsed;
      blk.refcount = 1;
      blk.last_access = now;
      blk.shared = false;
      out.push_back(b);
    }
    P.free_head = head;
    P.num_free -= k;
    G.num_free_blocks -= k;
    if (P.num_free == 0) remove_from_free_set(G, page);
  }
  defer_refresh_ = deferred;
  // a page just mapped enters the free set only if this run leaves it a free block
  if (P.num_free > 0) add_to_free_set(G, page);
  if (!deferred) refresh_page(g, page);
  return k;
}

// Step 3: evict whole evictable pages (any group, LRU by newest access, ties: longest
// prefix first) until group g's large page fits. Does nothing and returns false when even
// evicting all would not do.
bool Core::evict_pages_for(int32_t g, Counters& c, int32_t& reused_units) {
  const int64_t need = grp(g).units_per_page;
  if (free_units_ >= need || free_units_ + evictable_page_units_ < need) return false;
  const int64_t before = free_units_;
  while (free_units_ < need) evict_lru_page(c);
  reused_units = static_cast<int32_t>(std::min<int64_t>(need, free_units_ - before));
  return true;
}

}  // namespace jvmm::jenga
