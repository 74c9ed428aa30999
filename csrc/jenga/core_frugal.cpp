// Jenga allocator core: the frugal retry of a failed multi-group allocation.
//
// Rationale: `allocate` serves groups one after another, so group 0's step 2 (new page) or
// step 3 (evict pages) can spend the units group 1 needed, although group 0 could have used
// blocks that cost no units (its free or cached blocks on pages still in use).
//
// Approach: in frugal mode every group takes, in order, its own free blocks (step 1), new
// pages (step 2) and page eviction (step 3) only while the units they spend are *spare*
// (the pool keeps the minimum of the later groups and of this group's rest), any free
// block of the group (step 4) and its cached blocks (step 5), steps 1, 4 and 5 restricted
// to pages that are not wholly evictable; only then steps 2 and 3 without the limit. Where
// units are not tight this is the paper order; where they are, cached prefixes are given
// up only for the units a later group needs (without the spare steps the retry evicted
// every costless cached block first). Why this succeeds whenever any assignment under the step
// rules does: units are one fungible pool of free units plus the units of wholly evictable pages. A
// block on a page outside that pool costs nothing; a block taken from an evictable page makes the
// page unevictable, so it costs the pool that page's units, exactly like a new page of the group,
// and yields at most as many blocks. Group g thus needs at least ceil(max(0, n_g - costless_g) /
// B_g) pages of U_g units, and frugal mode takes exactly that many, from one pool that the other
// groups' costless choices never shrink; a spare page is taken only when the pool left still covers
// every such minimum.
//
// Limitations: once no units are spare, frugal mode evicts cached blocks (step 5) of pages
// in use, one block at a time, which cuts prefixes out of order; it only runs after the
// paper order failed.
// Setting aside step-5 heap entries on evictable pages costs O(k log n) for k such entries.
#include <algorithm>
#include <limits>

#include "jenga/core.hpp"

namespace jvmm::jenga {

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

// Necessary condition (cheap): even counting every free and cached block of a group as
// costless, the pages still needed must fit in free units plus evictable page units.
bool Core::may_fit_frugally(const std::vector<int32_t>& counts) const {
  int64_t units = 0;
  for (size_t g = 0; g < groups_.size(); ++g) {
    const Group& G = groups_[g];
    const int64_t short_by = counts[g] - G.num_free_blocks - G.num_cached_blocks;
    if (short_by > 0) units += ceil_div(short_by, G.blocks_per_page) * G.units_per_page;
  }
  return units <= free_units_ + evictable_page_units_;
}

int64_t Core::costless_blocks(const Group& G) const {
  return G.num_free_blocks + G.num_cached_blocks - G.num_evictable_pages * G.blocks_per_page;
}

int64_t Core::min_units(const Group& G, int64_t n) const {
  const int64_t short_by = std::max<int64_t>(0, n - costless_blocks(G));
  return ceil_div(short_by, G.blocks_per_page) * G.units_per_page;
}

// frugal_reserve_[g]: units the groups after g need at least, from the state before the
// frugal pass (a group's costless blocks change only by its own steps).
void Core::set_frugal_reserve(const std::vector<int32_t>& counts) {
  frugal_reserve_.assign(groups_.size(), 0);
  int64_t after = 0;
  for (size_t g = groups_.size(); g-- > 0;) {
    frugal_reserve_[g] = after;
    after += min_units(groups_[g], counts[g]);
  }
}

// A new page for g (n blocks still to take) is spare when the pool left after it still
// holds the later groups' minimum and g's own minimum for the blocks the page leaves.
bool Core::spare_units_for(int32_t g, int32_t n) const {
  const Group& G = groups_[static_cast<size_t>(g)];
  const int64_t pool_after = free_units_ + evictable_page_units_ - G.units_per_page;
  const int64_t own_after = min_units(G, std::max<int64_t>(0, n - G.blocks_per_page));
  return pool_after >= frugal_reserve_[static_cast<size_t>(g)] + own_after;
}

int32_t Core::frugal_own_free_page(const Group& G, int64_t owner) const {
  auto it = G.pages_with_free.lower_bound({owner, std::numeric_limits<int32_t>::min()});
  for (; it != G.pages_with_free.end() && it->first == owner; ++it) {
    if (!G.pages[static_cast<size_t>(it->second)].in_evictable) return it->second;
  }
  return -1;
}

int32_t Core::frugal_any_free_page(const Group& G) const {
  for (const auto& [owner, page] : G.pages_with_free) {
    if (!G.pages[static_cast<size_t>(page)].in_evictable) return page;
  }
  return -1;
}

// The least recently used cached block on a page that is not wholly evictable; entries
// of evictable pages above it are moved aside (restore_lru_aside puts them back).
int32_t Core::frugal_lru_top(Group& G) {
  for (int32_t b = lru_top(G); b >= 0; b = lru_top(G)) {
    if (!G.pages[static_cast<size_t>(page_of(G, b))].in_evictable) return b;
    std::pop_heap(G.lru.begin(), G.lru.end());
    lru_aside_.push_back(G.lru.back());
    G.lru.pop_back();
  }
  return -1;
}

void Core::restore_lru_aside(Group& G) {
  for (const LruEntry& e : lru_aside_) {
    if (!lru_live(G, e)) continue;  // its page was evicted by step 3 meanwhile
    G.lru.push_back(e);
    std::push_heap(G.lru.begin(), G.lru.end());
  }
  lru_aside_.clear();
}

}  // namespace jvmm::jenga
