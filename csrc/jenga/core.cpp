// Jenga allocator core: the allocate transaction, release/acquire, the hash index.
// Design note: core.hpp.
#include "jenga/core.hpp"

#include <algorithm>
#include <array>
#include <limits>
#include <stdexcept>

namespace jvmm::jenga {

namespace {

std::string str(int64_t v) { return std::to_string(v); }

constexpr size_t kPrefetchAhead = 8;  // hash-table slots requested ahead in batched loops

void check_clock(int64_t now) {
  if (now <= -kClockLimit || now >= kClockLimit) {
    throw std::invalid_argument("clock value " + str(now) + " outside (-2^61, 2^61)");
  }
}

}  // namespace

Core::Core(const std::vector<int32_t>& blocks_per_page, const std::vector<int32_t>& units_per_page,
           int64_t total_units, const Rules& rules, int32_t short_key_bits, bool record_plan)
    : total_units_(total_units), free_units_(total_units), record_plan_(record_plan) {
  if (short_key_bits < 0 || short_key_bits > 64) {
    throw std::invalid_argument("short_key_bits must be in [0, 64], got " + str(short_key_bits));
  }
  short_key_bits_ = short_key_bits;
  short_key_mask_ = short_key_bits == 64 ? ~uint64_t{0} : (uint64_t{1} << short_key_bits) - 1;
  if (blocks_per_page.empty() || blocks_per_page.size() != units_per_page.size()) {
    throw std::invalid_argument("need one (blocks_per_page, units_per_page) per group, got " +
                                str(blocks_per_page.size()) + " and " + str(units_per_page.size()));
  }
  if (total_units <= 0) {
    throw std::invalid_argument("total_units must be > 0, got " + str(total_units));
  }
  groups_.resize(blocks_per_page.size());
  one_counts_.assign(groups_.size(), 0);
  one_out_.resize(groups_.size());
  for (size_t g = 0; g < groups_.size(); ++g) {
    if (blocks_per_page[g] <= 0 || units_per_page[g] <= 0) {
      throw std::invalid_argument("group " + str(static_cast<int64_t>(g)) +
                                  ": blocks_per_page and units_per_page must be > 0, got " +
                                  str(blocks_per_page[g]) + " and " + str(units_per_page[g]));
    }
    groups_[g].blocks_per_page = blocks_per_page[g];
    const auto d = static_cast<uint64_t>(blocks_per_page[g]);
    int32_t l = 0;
    while ((uint64_t{1} << l) < d) ++l;
    groups_[g].page_magic = ((uint64_t{1} << (32 + l)) + d - 1) / d;
    groups_[g].page_shift = 32 + l;
    groups_[g].units_per_page = units_per_page[g];
  }
  set_rules(rules);
}

void Core::set_rules(const Rules& rules) {
  const std::vector<bool>& flags = rules.early_release_groups;
  if (!flags.empty() && flags.size() != groups_.size()) {
    throw std::invalid_argument("need one early-release flag per group: got " + str(flags.size()) +
                                " for " + str(groups_.size()) + " groups");
  }
  const std::vector<int32_t>& window = rules.window_blocks;
  if (!window.empty() && window.size() != groups_.size()) {
    throw std::invalid_argument("need one window block count per group: got " + str(window.size()) +
                                " for " + str(groups_.size()) + " groups");
  }
  for (const int32_t w : window) {
    if (w < 0) throw std::invalid_argument("window block counts must be >= 0, got " + str(w));
  }
  const std::vector<int64_t>& reach = rules.retention_reach;
  if (!reach.empty() && reach.size() != groups_.size()) {
    throw std::invalid_argument("need one retention reach per group: got " + str(reach.size()) +
                                " for " + str(groups_.size()) + " groups");
  }
  for (const int64_t r : reach) {
    if (r < -1) throw std::invalid_argument("retention reaches must be >= -1, got " + str(r));
  }
  if (rules.retention_interval < 0) {
    throw std::invalid_argument("retention_interval must be >= 0, got " +
                                str(rules.retention_interval));
  }
  rules_ = rules;
  if (flags.empty()) rules_.early_release_groups.assign(groups_.size(), false);
  if (window.empty()) rules_.window_blocks.assign(groups_.size(), 0);
  if (reach.empty()) rules_.retention_reach.assign(groups_.size(), -1);
  order_ = build_order(rules_);
  pack_order_ = build_pack_order(rules_);
}

const Group& Core::group(int32_t g) const {
  if (g < 0 || g >= num_groups()) {
    throw std::out_of_range("group " + str(g) + " out of range [0, " + str(num_groups()) + ")");
  }
  return groups_[static_cast<size_t>(g)];
}

int32_t Core::num_used(const Group& G, int32_t page) const {
  const Page& P = G.pages[static_cast<size_t>(page)];
  return G.blocks_per_page - P.num_free - P.num_cached;
}

// ---------------------------------------------------------------------------------------
// allocate: a transaction over the five steps
// ---------------------------------------------------------------------------------------

std::optional<std::vector<std::vector<int32_t>>> Core::allocate(
    int64_t owner, const std::vector<int32_t>& counts, int64_t now,
    const std::vector<std::vector<int32_t>>& releases) {
  std::vector<std::vector<int32_t>> out(groups_.size());
  if (!allocate_into(owner, counts, now, releases, out)) return std::nullopt;
  return out;
}

bool Core::allocate_one(int32_t g, int64_t owner, int32_t n, int64_t now,
                        std::vector<int32_t>& out) {
  group(g);  // throws std::out_of_range on a bad group
  out.clear();
  one_counts_[static_cast<size_t>(g)] = n;
  bool ok = false;
  try {
    ok = allocate_into(owner, one_counts_, now, {}, one_out_);
  } catch (...) {
    one_counts_[static_cast<size_t>(g)] = 0;
    throw;
  }
  one_counts_[static_cast<size_t>(g)] = 0;
  if (ok) out.swap(one_out_[static_cast<size_t>(g)]);
  return ok;
}

// Throws (nothing changed) on bad shapes, a bad clock or a release of a block not in use.
void Core::validate_allocate(const std::vector<int32_t>& counts,
                             const std::vector<std::vector<int32_t>>& releases, int64_t now) {
  if (counts.size() != groups_.size()) {
    throw std::invalid_argument("need one count per group: got " + str(counts.size()) + " for " +
                                str(groups_.size()) + " groups");
  }
  for (size_t g = 0; g < counts.size(); ++g) {
    if (counts[g] < 0) {
      throw std::invalid_argument("group " + str(static_cast<int64_t>(g)) +
                                  ": block count must be >= 0, got " + str(counts[g]));
    }
  }
  if (!releases.empty() && releases.size() != groups_.size()) {
    throw std::invalid_argument("need one release list per group (or none): got " +
                                str(releases.size()) + " for " + str(groups_.size()) + " groups");
  }
  check_clock(now);
  for (size_t g = 0; g < releases.size(); ++g)
    validate_release(static_cast<int32_t>(g), releases[g].data(), releases[g].size());
}

// allocate()'s transaction; out holds one vector per group (capacity reused).
bool Core::allocate_into(int64_t owner, const std::vector<int32_t>& counts, int64_t now,
                         const std::vector<std::vector<int32_t>>& releases,
                         std::vector<std::vector<int32_t>>& out) {
  validate_allocate(counts, releases, now);
  Counters c;
  const size_t plan_mark = plan_.size();
  const Counters saved = counters_;
  undo_.clear();
  logging_ = true;
  for (size_t g = 0; g < releases.size(); ++g) {
    const auto& rel = releases[g];
    const bool early = rules_.early_release_groups[g];
    for (auto it = rel.rbegin(); it != rel.rend(); ++it)
      prim_release(static_cast<int32_t>(g), *it, now, early);
  }
  const size_t released_undo = undo_.size();
  const size_t plan_released = plan_.size();
  // nothing to undo can be needed: no release to roll back, no group can be refused
  const bool sure = releases.empty() && surely_fits(counts);
  logging_ = !sure;
  bool ok = allocate_groups(order_, owner, counts, now, c, out);
  if (!ok && sure) {
    throw std::logic_error("allocation refused although surely_fits held (core bug)");
  }
  if (!ok) {
    // Undo the groups (not the releases), then retry frugally if the bound allows it.
    rollback(released_undo, plan_released);
    logging_ = true;
    if (rules_.frugal_retry && may_fit_frugally(counts)) {
      set_frugal_reserve(counts);
      c = Counters{};
      c.frugal_retries = 1;
      ok = allocate_groups(frugal_order_, owner, counts, now, c, out);
    }
  }
  if (!ok) {
    refuse(plan_mark, saved, c);
    return false;
  }
  logging_ = false;
  undo_.clear();
  add_counters(c);
  return true;
}

void Core::refuse(size_t plan_mark, const Counters& saved, const Counters& c) {
  rollback(0, plan_mark);
  logging_ = false;
  counters_ = saved;
  counters_.alloc_calls += 1;
  counters_.alloc_failures += 1;
  counters_.frugal_retries += c.frugal_retries;
}

void Core::add_counters(const Counters& c) {
  for (size_t i = 0; i < c.step_blocks.size(); ++i) counters_.step_blocks[i] += c.step_blocks[i];
  counters_.pages_mapped += c.pages_mapped;
  counters_.pages_unmapped += c.pages_unmapped;
  counters_.pages_evicted += c.pages_evicted;
  counters_.blocks_evicted += c.blocks_evicted;
  counters_.remapped_units += c.remapped_units;
  counters_.frugal_retries += c.frugal_retries;
  counters_.alloc_calls += 1;
}

// Every group in order; false at the first group that cannot be served (out is reset).
bool Core::allocate_groups(const StepOrder& order, int64_t owner,
                           const std::vector<int32_t>& counts, int64_t now, Counters& c,
                           std::vector<std::vector<int32_t>>& out) {
  for (size_t g = 0; g < groups_.size(); ++g) {
    out[g].clear();
    out[g].reserve(static_cast<size_t>(counts[g]));
    // pack_window_blocks: the blocks the request keeps (the call's last window_blocks[g])
    // go where live blocks already pin a page; the ones before them leave right after
    const int32_t kept = rules_.pack_window_blocks && &order == &order_
                             ? std::min(counts[g], rules_.window_blocks[g])
                             : 0;
    StepCall s{static_cast<int32_t>(g), owner, counts[g] - kept, now, c, out[g]};
    if (!allocate_group(order, s)) return false;
    StepCall k{static_cast<int32_t>(g), owner, kept, now, c, out[g]};
    if (!allocate_group(pack_order_, k)) return false;
  }
  return true;
}

bool Core::surely_fits(const std::vector<int32_t>& counts) const {
  int64_t units = 0;
  int busy = 0;
  for (size_t g = 0; g < counts.size(); ++g) {
    if (counts[g] == 0) continue;
    busy += 1;
    const Group& G = groups_[g];
    const int64_t shortfall = int64_t{counts[g]} - G.num_free_blocks;
    if (shortfall > 0) {
      units += (shortfall + G.blocks_per_page - 1) / G.blocks_per_page * G.units_per_page;
    }
  }
  // paper order maps new pages before taking others' free blocks: one group may then
  // use more units than its shortfall, so only a single group is certain
  if (busy > 1 && rules_.order == AllocationOrder::kPaper) return false;
  return units <= free_units_;
}

int64_t Core::evict_cached_pages(int64_t units) {
  if (units < 0) throw std::invalid_argument("units must be >= 0, got " + str(units));
  const int64_t before = free_units_;
  const size_t plan_mark = plan_.size();
  Counters c;
  undo_.clear();
  logging_ = true;
  try {
    while (free_units_ - before < units && !evictable_pages_.empty()) evict_lru_page(c);
  } catch (...) {
    rollback(0, plan_mark);
    logging_ = false;
    throw;
  }
  logging_ = false;
  undo_.clear();
  counters_.pages_evicted += c.pages_evicted;
  counters_.pages_unmapped += c.pages_unmapped;
  counters_.blocks_evicted += c.blocks_evicted;
  return free_units_ - before;
}

int64_t Core::uncache_blocks(int32_t g, const std::vector<int32_t>& blocks) {
  Group& G = grp(g);
  for (const int32_t b : blocks) {
    if (b < 0 || static_cast<size_t>(b) >= G.blocks.size()) {
      throw std::out_of_range("block " + str(b) + " is outside group " + str(g) + "'s " +
                              str(static_cast<int64_t>(G.blocks.size())) + " blocks");
    }
  }
  int64_t dropped = 0;
  for (const int32_t b : blocks) {
    Block& k = G.blocks[static_cast<size_t>(b)];
    if (!k.hashed) continue;
    ++dropped;
    if (k.state != State::kCached) {  // USED: the index forgets it, the holders keep it
      if (G.hash_to_block.find(short_key(k.hash)) == b) G.hash_to_block.erase(short_key(k.hash));
      k.hashed = false;
      continue;
    }
    prim_uncache(g, b);
    prim_push_free(g, b);
    counters_.blocks_evicted += 1;
    const int32_t page = page_of(G, b);
    if (G.pages[static_cast<size_t>(page)].num_free == G.blocks_per_page) {
      prim_unmap(g, page);
      counters_.pages_unmapped += 1;
    }
  }
  return dropped;
}

void Core::evict_lru_page(Counters& c) {
  const PageKey victim = *evictable_pages_.begin();
  const int32_t g = std::get<2>(victim);
  const int32_t page = std::get<3>(victim);
  c.blocks_evicted += grp(g).pages[static_cast<size_t>(page)].num_cached;
  evict_page(g, page);
  c.pages_evicted += 1;
  c.pages_unmapped += 1;
}

void Core::evict_page(int32_t g, int32_t page) {
  Group& G = grp(g);
  set_page_evictable(g, page, false);
  defer_refresh_ = true;
  const int32_t B = G.blocks_per_page;
  for (int32_t slot = 0; slot < B; ++slot) {
    const int32_t b = page * B + slot;
    if (slot + static_cast<int32_t>(kPrefetchAhead) < B) {
      const Block& ahead = G.blocks[static_cast<size_t>(b) + kPrefetchAhead];
      if (ahead.hashed) G.hash_to_block.prefetch(short_key(ahead.hash));
    }
    if (G.blocks[static_cast<size_t>(b)].state == State::kCached) {
      prim_uncache(g, b);
      prim_push_free(g, b);
    }
  }
  defer_refresh_ = false;
  prim_unmap(g, page);
}

// ---------------------------------------------------------------------------------------
// release / acquire / commit / lookup
// ---------------------------------------------------------------------------------------

// Throws (nothing changed) unless every listed block is USED with enough references for
// the number of times it is listed.
void Core::validate_release(int32_t g, const int32_t* blocks, size_t n) {
  Group& G = grp((group(g), g));
  const int64_t limit = static_cast<int64_t>(G.blocks.size());
  size_t done = 0;
  for (; done < n; ++done) {
    const int32_t b = blocks[done];
    if (b < 0 || b >= limit || G.blocks[static_cast<size_t>(b)].state != State::kUsed ||
        G.blocks[static_cast<size_t>(b)].refcount <= 0) {
      break;
    }
    G.blocks[static_cast<size_t>(b)].refcount -= 1;
  }
  for (size_t i = 0; i < done; ++i) G.blocks[static_cast<size_t>(blocks[i])].refcount += 1;
  if (done != n) {
    throw std::invalid_argument("group " + str(g) + ": block " + str(blocks[done]) +
                                " is not in use (release of a free, cached or unknown block; " +
                                str(limit) + " block ids exist)");
  }
}

void Core::release(int32_t g, const std::vector<int32_t>& blocks, int64_t now) {
  release(g, blocks.data(), blocks.size(), now);
}

void Core::release(int32_t g, const int32_t* blocks, size_t n, int64_t now) {
  check_clock(now);
  validate_release(g, blocks, n);
  // Tail first: a request's later blocks carry longer prefixes, so with one release time
  // they come out evicted-first; pushing them last-to-first keeps each heap push O(1).
  // A page's evictable key is refreshed once per run of its blocks (not once per block).
  // Free-set membership too: a run that frees a whole page unmaps it without entering it.
  // Outside a transaction nothing is logged, so prim_release's work is done here inline:
  // one pass, the group's arrays hoisted (prim_release is the logging path).
  if (logging_) throw std::logic_error("release() inside an allocate transaction");
  Group& G = grp(g);
  const int32_t B = G.blocks_per_page;
  Block* const all = G.blocks.data();
  defer_refresh_ = true;
  defer_free_set_ = true;
  int32_t run = -1;
  for (size_t i = n; i-- > 0;) {
    const int32_t b = blocks[i];
    const int32_t page = page_of(G, b);
    if (page != run && run >= 0) settle_page(g, run);
    run = page;
    Block& k = all[b];
    if (--k.refcount > 0) continue;
    Page& P = G.pages[static_cast<size_t>(page)];
    k.last_access = now;
    k.early = false;
    k.demoted = false;
    counters_.blocks_released += 1;
    if (k.hashed) {
      k.state = State::kCached;
      lru_insert(G, b);
      P.num_cached += 1;
      G.num_cached_blocks += 1;
      continue;
    }
    k.state = State::kFree;  // prim_push_free (its free-set entry: settle_page)
    k.next_free = P.free_head;
    P.free_head = b - page * B;
    P.num_free += 1;
    G.num_free_blocks += 1;
    if (P.num_free == B) {
      prim_unmap(g, page);
      counters_.pages_unmapped += 1;
    }
  }
  defer_refresh_ = false;
  defer_free_set_ = false;
  if (run >= 0) settle_page(g, run);
}

void Core::acquire(int32_t g, const std::vector<int32_t>& blocks, int64_t now) {
  check_clock(now);
  Group& G = grp((group(g), g));
  const int64_t limit = static_cast<int64_t>(G.blocks.size());
  for (const int32_t b : blocks) {
    if (b < 0 || b >= limit ||
        (G.blocks[static_cast<size_t>(b)].state != State::kUsed &&
         G.blocks[static_cast<size_t>(b)].state != State::kCached)) {
      throw std::invalid_argument("group " + str(g) + ": block " + str(b) +
                                  " is neither in use nor cached; cannot share it");
    }
  }
  for (const int32_t b : blocks) {
    Block& k = G.blocks[static_cast<size_t>(b)];
    const int32_t page = page_of(G, b);
    if (k.state == State::kCached) {
      lru_remove(G, b);
      G.pages[static_cast<size_t>(page)].num_cached -= 1;
      G.num_cached_blocks -= 1;
      k.state = State::kUsed;
    }
    k.refcount += 1;
    k.last_access = now;
    k.shared = true;
    counters_.blocks_acquired += 1;
    refresh_page(g, page);
  }
}

int64_t Core::commit(int32_t g, const std::vector<int32_t>& blocks,
                     const std::vector<Identity>& hashes, const std::vector<int64_t>& prefix_lens) {
  Group& G = grp((group(g), g));
  if (blocks.size() != hashes.size() || blocks.size() != prefix_lens.size()) {
    throw std::invalid_argument("commit needs equal lengths, got " + str(blocks.size()) +
                                " blocks, " + str(hashes.size()) + " hashes, " +
                                str(prefix_lens.size()) + " prefix lengths");
  }
  const int64_t limit = static_cast<int64_t>(G.blocks.size());
  for (const int32_t b : blocks) {
    if (b < 0 || b >= limit || G.blocks[static_cast<size_t>(b)].state != State::kUsed) {
      throw std::invalid_argument("group " + str(g) + ": block " + str(b) +
                                  " is not in use; only owned blocks can be cached");
    }
  }
  int64_t added = 0;
  for (size_t i = 0; i < blocks.size(); ++i) {
    Block& k = G.blocks[static_cast<size_t>(blocks[i])];
    if (k.hashed || !index_block(G, blocks[i], hashes[i])) continue;
    k.prefix_len = prefix_lens[i];
    added += 1;
  }
  counters_.hashes_committed += added;
  return added;
}

bool Core::index_block(Group& G, int32_t block, const Identity& id) {
  const uint64_t key = short_key(id);
  if (!G.hash_to_block.insert(key, block)) {
    // the key is taken: by this very identity (a duplicate, skipped as before) or by
    // another one (a short-key collision: this block stays out of the index)
    const int32_t holder = G.hash_to_block.find(key);
    if (G.blocks[static_cast<size_t>(holder)].hash != id) counters_.identity_collisions += 1;
    return false;
  }
  Block& k = G.blocks[static_cast<size_t>(block)];
  k.hashed = true;
  k.hash = id;
  return true;
}

int64_t Core::commit_run(int32_t g, const std::vector<int32_t>& blocks, const Identity* hashes,
                         int64_t first_prefix, int64_t step) {
  Group& G = grp((group(g), g));
  const int64_t limit = static_cast<int64_t>(G.blocks.size());
  for (const int32_t b : blocks) {
    if (b >= limit || (b >= 0 && G.blocks[static_cast<size_t>(b)].state != State::kUsed)) {
      throw std::invalid_argument("group " + str(g) + ": block " + str(b) +
                                  " is not in use; only owned blocks can be cached");
    }
  }
  int64_t added = 0;
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (i + kPrefetchAhead < blocks.size()) {
      G.hash_to_block.prefetch(short_key(hashes[i + kPrefetchAhead]));
    }
    if (blocks[i] < 0) continue;
    Block& k = G.blocks[static_cast<size_t>(blocks[i])];
    if (k.hashed || !index_block(G, blocks[i], hashes[i])) continue;
    k.prefix_len = first_prefix + static_cast<int64_t>(i) * step;
    added += 1;
  }
  counters_.hashes_committed += added;
  return added;
}

void Core::lookup(int32_t g, const Identity* hashes, size_t n, int32_t* out) {
  const Group& G = group(g);
  for (size_t i = 0; i < n; ++i) {
    if (i + kPrefetchAhead < n) G.hash_to_block.prefetch(short_key(hashes[i + kPrefetchAhead]));
    const int32_t b = G.hash_to_block.find(short_key(hashes[i]));
    if (b >= 0 && G.blocks[static_cast<size_t>(b)].hash != hashes[i]) {
      counters_.identity_mismatches += 1;  // the short key collided: never served
      out[i] = -1;
    } else {
      out[i] = b;
    }
  }
}

std::vector<PlanOp> Core::drain_plan() {
  std::vector<PlanOp> out;
  out.swap(plan_);
  return out;
}

std::vector<int32_t> Core::eviction_order(int32_t g) const {
  const Group& G = group(g);
  std::vector<LruEntry> live;
  for (const LruEntry& e : G.lru) {
    if (lru_live(G, e)) live.push_back(e);
  }
  std::sort(live.begin(), live.end(), [](const LruEntry& a, const LruEntry& b) { return b < a; });
  std::vector<int32_t> out;
  for (const LruEntry& e : live) out.push_back(e.block);
  return out;
}

std::vector<std::pair<int32_t, int32_t>> Core::page_eviction_order() const {
  std::vector<std::pair<int32_t, int32_t>> out;
  for (const PageKey& key : evictable_pages_) out.push_back({std::get<2>(key), std::get<3>(key)});
  return out;
}

void Core::set_total_units(int64_t units) {
  if (units <= 0) throw std::invalid_argument("total_units must be > 0, got " + str(units));
  const int64_t in_use = total_units_ - free_units_;
  if (units < in_use) {
    throw std::invalid_argument("cannot shrink to " + str(units) + " units: " + str(in_use) +
                                " are mapped (" + str(evictable_page_units_) +
                                " of them on evictable pages)");
  }
  free_units_ += units - total_units_;
  total_units_ = units;
}

}  // namespace jvmm::jenga
