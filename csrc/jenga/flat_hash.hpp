// Open-addressing hash map uint64 -> int32 for the prefix index (linear probing,
// backward-shift deletion, so no tombstones and lookups never slow down with churn).
//
// Why not std::unordered_map: one heap node per entry makes insert/erase ~100-200 ns at
// a million entries; here an entry is 16 contiguous bytes. The home slot is Fibonacci
// hashing (key * 2^64/phi, top bits), so even sequential keys spread out and probe runs
// stay short (backward-shift deletion scans to the end of a run). Load factor <= 1/2.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace jvmm::jenga {

class FlatHashMap {
 public:
  FlatHashMap() { slots_.resize(16); }

  size_t home(uint64_t key) const { return static_cast<size_t>((key * kFib) >> shift_); }

  size_t size() const { return size_; }
  size_t memory_bytes() const { return slots_.capacity() * sizeof(Slot); }

  // Value for key, or -1.
  int32_t find(uint64_t key) const {
    for (size_t i = home(key); slots_[i].value >= 0; i = (i + 1) & mask()) {
      if (slots_[i].key == key) return slots_[i].value;
    }
    return -1;
  }

  bool contains(uint64_t key) const { return find(key) >= 0; }

  // Batched callers prefetch a few keys ahead: at a million entries the table is larger
  // than the caches and each first probe is a memory miss.
  void prefetch(uint64_t key) const { __builtin_prefetch(&slots_[home(key)]); }

  // Inserts when absent; returns false (and changes nothing) when the key is present.
  bool insert(uint64_t key, int32_t value) {
    if (2 * (size_ + 1) > slots_.size()) grow();
    size_t i = home(key);
    for (; slots_[i].value >= 0; i = (i + 1) & mask()) {
      if (slots_[i].key == key) return false;
    }
    slots_[i] = {key, value};
    ++size_;
    return true;
  }

  // Removes key if present; returns whether it was.
  bool erase(uint64_t key) {
    size_t i = home(key);
    for (; slots_[i].value >= 0; i = (i + 1) & mask()) {
      if (slots_[i].key == key) break;
    }
    if (slots_[i].value < 0) return false;
    // backward shift: pull later entries of the probe run into the hole
    size_t hole = i;
    for (size_t j = (i + 1) & mask(); slots_[j].value >= 0; j = (j + 1) & mask()) {
      const size_t h = home(slots_[j].key);
      const bool movable = ((j - h) & mask()) >= ((j - hole) & mask());
      if (movable) {
        slots_[hole] = slots_[j];
        hole = j;
      }
    }
    slots_[hole] = {0, -1};
    --size_;
    return true;
  }

  template <typename F>
  void for_each(F&& f) const {
    for (const Slot& s : slots_) {
      if (s.value >= 0) f(s.key, s.value);
    }
  }

 private:
  struct Slot {
    uint64_t key = 0;
    int32_t value = -1;  // -1: empty
  };

  size_t mask() const { return slots_.size() - 1; }

  void grow() {
    std::vector<Slot> old(slots_.size() * 2);
    old.swap(slots_);
    shift_ -= 1;
    size_ = 0;
    for (const Slot& s : old) {
      if (s.value >= 0) insert(s.key, s.value);
    }
  }

  static constexpr uint64_t kFib = 0x9E3779B97F4A7C15ULL;
  std::vector<Slot> slots_;
  size_t size_ = 0;
  int shift_ = 64 - 4;  // log2(16 slots)
};

}  // namespace jvmm::jenga
