// Block hashes for the prefix cache: chained over token ids so a block's hash names its
// whole prefix, not just its own tokens (two equal blocks after different prefixes differ).
// 64-bit multiply-rotate mixing per token, a murmur3 finalizer per block; not
// cryptographic (a deliberate collision would alias two prefixes), but fast: ~1 ns/token.
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "jenga/core.hpp"

namespace jvmm::jenga {

namespace {

constexpr uint64_t kMul1 = 0x9E3779B97F4A7C15ULL;
constexpr uint64_t kMul2 = 0xC2B2AE3D27D4EB4FULL;

inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

inline uint64_t fmix64(uint64_t k) {
  k ^= k >> 33;
  k *= 0xFF51AFD7ED558CCDULL;
  k ^= k >> 33;
  k *= 0xC4CEB9FE1A85EC53ULL;
  k ^= k >> 33;
  return k;
}

inline uint64_t mix_word(uint64_t acc, uint64_t word) {
  return rotl(acc ^ (word * kMul2), 31) * kMul1;
}

}  // namespace

std::vector<uint64_t> hash_token_blocks(const int64_t* tokens, int64_t num_tokens,
                                        int64_t tokens_per_block, uint64_t parent) {
  if (tokens_per_block <= 0) {
    throw std::invalid_argument("tokens_per_block must be > 0, got " +
                                std::to_string(tokens_per_block));
  }
  const int64_t num_blocks = num_tokens / tokens_per_block;
  std::vector<uint64_t> out(static_cast<size_t>(num_blocks));
  for (int64_t i = 0; i < num_blocks; ++i) {
    uint64_t acc = parent ^ static_cast<uint64_t>(tokens_per_block);
    const int64_t* t = tokens + i * tokens_per_block;
    for (int64_t j = 0; j < tokens_per_block; ++j) acc = mix_word(acc, static_cast<uint64_t>(t[j]));
    parent = fmix64(acc);
    out[static_cast<size_t>(i)] = parent;
  }
  return out;
}

uint64_t hash_ints(const std::vector<int64_t>& values, uint64_t seed) {
  uint64_t acc = fmix64(seed ^ kMul2) ^ static_cast<uint64_t>(values.size());
  for (const int64_t v : values) acc = mix_word(acc, static_cast<uint64_t>(v));
  return fmix64(acc);
}

}  // namespace jvmm::jenga
