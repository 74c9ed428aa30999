// Jenga allocator core: check_invariants, cheap tier (unit and set accounting) and
// expensive tier (every page, block, heap entry and hash entry recounted).
#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "jenga/core.hpp"

namespace jvmm::jenga {

namespace {

std::string str(int64_t v) { return std::to_string(v); }

void require(bool ok, const std::string& what) {
  if (!ok) throw std::logic_error("jenga core invariant violated: " + what);
}

}  // namespace

void Core::check_invariants(bool expensive) const {
  int64_t mapped_units = 0;
  for (const Group& G : groups_) mapped_units += G.num_mapped_pages * G.units_per_page;
  require(free_units_ >= 0 && free_units_ <= total_units_,
          "free units " + str(free_units_) + " outside [0, " + str(total_units_) + "]");
  require(free_units_ + mapped_units == total_units_, "free " + str(free_units_) + " + mapped " +
                                                          str(mapped_units) + " units != total " +
                                                          str(total_units_));
  int64_t evictable_units = 0;
  for (const PageKey& key : evictable_pages_) {
    evictable_units += groups_[static_cast<size_t>(std::get<2>(key))].units_per_page;
  }
  require(
      evictable_units == evictable_page_units_,
      "evictable page units " + str(evictable_page_units_) + " != recount " + str(evictable_units));
  require(!logging_ && undo_.empty(), "a transaction is still open");
  for (int32_t g = 0; g < num_groups(); ++g) check_group(g, expensive);
}

void Core::check_group(int32_t g, bool expensive) const {
  const Group& G = groups_[static_cast<size_t>(g)];
  const std::string where = "group " + str(g) + ": ";
  require(G.blocks.size() == G.pages.size() * static_cast<size_t>(G.blocks_per_page),
          where + "block array size does not match pages");
  if (!expensive) return;
  const std::vector<char> in_lru = check_lru(G, where);
  std::vector<char> on_free_list(G.pages.size(), 0);
  for (const int32_t p : G.free_page_ids) {
    require(p >= 0 && static_cast<size_t>(p) < G.pages.size() && !on_free_list[p],
            where + "bad free page id " + str(p));
    on_free_list[static_cast<size_t>(p)] = 1;
  }
  PageTally tally;
  for (int32_t p = 0; p < static_cast<int32_t>(G.pages.size()); ++p) {
    const Page& P = G.pages[static_cast<size_t>(p)];
    require(P.mapped != static_cast<bool>(on_free_list[static_cast<size_t>(p)]),
            where + "page " + str(p) + ": mapped flag disagrees with the free page list");
    check_page(g, p, in_lru, tally);
  }
  require(tally.mapped == G.num_mapped_pages, where + "mapped page count wrong");
  require(tally.evictable == G.num_evictable_pages, where + "evictable page count wrong");
  require(tally.cached == G.num_cached_blocks, where + "cached block count wrong");
  require(tally.free_blocks == G.num_free_blocks, where + "free block count wrong");
  require(G.pages_with_free.size() <= static_cast<size_t>(tally.mapped),
          where + "stale free-set entries");
  G.hash_to_block.for_each([&](uint64_t hash, int32_t b) {
    require(b >= 0 && static_cast<size_t>(b) < G.blocks.size() &&
                G.blocks[static_cast<size_t>(b)].hashed &&
                short_key(G.blocks[static_cast<size_t>(b)].hash) == hash,
            where + "hash index entry points at block " + str(b) + " without that hash");
  });
}

// Live heap entries: one per CACHED block, keyed by its current (evict_time, prefix).
std::vector<char> Core::check_lru(const Group& G, const std::string& where) const {
  require(std::is_heap(G.lru.begin(), G.lru.end()), where + "LRU heap order broken");
  std::vector<char> in_lru(G.blocks.size(), 0);
  int64_t live = 0;
  for (const LruEntry& e : G.lru) {
    if (!lru_live(G, e)) continue;
    const Block& k = G.blocks[static_cast<size_t>(e.block)];
    require(!in_lru[static_cast<size_t>(e.block)] && e.last_access == evict_time(k) &&
                e.tie == evict_tie(k),
            where + "LRU entry of block " + str(e.block) + " duplicated or with a stale key");
    in_lru[static_cast<size_t>(e.block)] = 1;
    ++live;
  }
  require(live == G.num_cached_blocks, where + "LRU heap holds " + str(live) +
                                           " live blocks, count says " + str(G.num_cached_blocks));
  return in_lru;
}

void Core::check_page(int32_t g, int32_t p, const std::vector<char>& in_lru,
                      PageTally& tally) const {
  const Group& G = groups_[static_cast<size_t>(g)];
  const Page& P = G.pages[static_cast<size_t>(p)];
  const int32_t B = G.blocks_per_page;
  const std::string pw = "group " + str(g) + ": page " + str(p) + ": ";
  int32_t chain = 0;
  for (int32_t s = P.free_head; s != -1; s = G.blocks[static_cast<size_t>(p * B + s)].next_free) {
    require(chain < B, pw + "free chain has a cycle");
    require(G.blocks[static_cast<size_t>(p * B + s)].state == State::kFree,
            pw + "slot " + str(s) + " on the free chain is not FREE");
    ++chain;
  }
  int32_t n_free = 0, n_cached = 0;
  PageAge age;
  for (int32_t b = p * B; b < (p + 1) * B; ++b) {
    const Block& k = G.blocks[static_cast<size_t>(b)];
    require(k.state != State::kLimbo, pw + "block " + str(b) + " left in LIMBO");
    require((k.state == State::kUsed) == (k.refcount > 0),
            pw + "block " + str(b) + " refcount " + str(k.refcount) + " disagrees with state");
    require(P.mapped || k.state == State::kFree, pw + "unmapped page holds a live block");
    n_free += k.state == State::kFree ? 1 : 0;
    if (k.state == State::kCached) {
      ++n_cached;
      age.add(evict_time(k), evict_tie(k));
      require(k.hashed && in_lru[static_cast<size_t>(b)],
              pw + "cached block " + str(b) + " missing from the LRU heap");
    }
    require(!k.hashed || G.hash_to_block.find(short_key(k.hash)) == b,
            pw + "hashed block " + str(b) + " missing from the hash index");
  }
  require(chain == n_free && n_free == P.num_free, pw + "free chain " + str(chain) +
                                                       ", FREE blocks " + str(n_free) + ", count " +
                                                       str(P.num_free));
  require(n_cached == P.num_cached,
          pw + "cached count " + str(P.num_cached) + " != " + str(n_cached));
  const bool free_set = G.pages_with_free.count({P.owner, p}) == 1;
  require(free_set == (P.mapped && n_free > 0), pw + "pages_with_free membership wrong");
  require(!P.mapped || n_free < B, pw + "mapped page with every block free");
  const bool evictable = P.mapped && n_cached > 0 && n_free + n_cached == B;
  require(evictable == P.in_evictable, pw + "evictable flag wrong");
  require(!evictable || (P.evict_key == age.newest && P.evict_tie == age.tie &&
                         evictable_pages_.count({age.newest, age.tie, g, p}) == 1),
          pw + "evictable page key wrong");
  tally.mapped += P.mapped ? 1 : 0;
  tally.evictable += evictable ? 1 : 0;
  tally.free_blocks += P.mapped ? n_free : 0;
  tally.cached += n_cached;
}

int64_t Core::memory_bytes() const {
  constexpr size_t kNodeHeader = 32;  // a std::set node: color, parent, left, right
  auto bytes = [](const auto& v) { return v.capacity() * sizeof(v[0]); };
  size_t total = sizeof(Core) + bytes(groups_) + bytes(plan_) + bytes(undo_) + bytes(lru_aside_) +
                 bytes(frugal_reserve_) + bytes(one_counts_) + bytes(one_out_) +
                 evictable_pages_.size() * (sizeof(PageKey) + kNodeHeader);
  for (const auto& v : one_out_) total += bytes(v);
  for (const Group& G : groups_) {
    total += bytes(G.pages) + bytes(G.blocks) + bytes(G.free_page_ids) + bytes(G.lru) +
             G.hash_to_block.memory_bytes() +
             G.pages_with_free.size() * (sizeof(std::pair<int64_t, int32_t>) + kNodeHeader);
  }
  return static_cast<int64_t>(total);
}

}  // namespace jvmm::jenga
