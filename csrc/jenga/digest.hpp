// Block identity for the prefix cache: 128 bits of a keyed or cryptographic digest.
//
// Rationale: a prefix-cache hit hands one request the KV another request computed, so two
// different prefixes must never share an identity, not even when someone picks the token
// ids on purpose. A 64-bit non-cryptographic chain (the old key) is cheap to collide; a
// 128-bit cut of keyed BLAKE2b (RFC 7693) or of SHA-256 / HMAC-SHA-256 (FIPS 180-4,
// RFC 2104) is not: with a secret key no offline search applies, and without one a
// collision costs ~2^64 digest evaluations.
//
// Approach: `BlockHasher` holds the algorithm and the key, with the state after the key
// block(s) precomputed, so a short message costs its own compressions only. Messages:
//   block  0x01 | parent identity (16 bytes) | width (4 or 8) | T tokens, little-endian,
//          `width` bytes each (4 when every token of the block fits in 32 bits) | extra
//   other  0x00 | caller's bytes (roots, image keys: built and length-prefixed in Python)
// The first byte separates the two domains; within a chain (fixed T, from its root) the
// width byte and T fix where the extra bytes start, so the encoding is injective.
// Identities are the digest's first 16 bytes as two little-endian 64-bit words.
//
// Limitations: the implementations are portable C++ (no SIMD); a 16-token block costs one
// BLAKE2b compression (two with 64-bit token ids or a long extra).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace jvmm::jenga {

struct Identity {
  uint64_t lo = 0;
  uint64_t hi = 0;
  bool operator==(const Identity& o) const { return lo == o.lo && hi == o.hi; }
  bool operator!=(const Identity& o) const { return !(*this == o); }
};

enum class HashAlgorithm : int32_t { kBlake2b = 0, kSha256 = 1 };

// One-shot digests (exposed for the tests that compare them with Python's hashlib/hmac).
// BLAKE2b with an optional key (<= 64 bytes) and a digest of 1..64 bytes.
std::vector<uint8_t> blake2b(const uint8_t* data, size_t len, const std::string& key,
                             size_t digest_size);
// SHA-256 of data, or HMAC-SHA-256 when key is not empty.
std::vector<uint8_t> sha256(const uint8_t* data, size_t len, const std::string& key);

class BlockHasher {
 public:
  // Throws std::invalid_argument for a BLAKE2b key over 64 bytes.
  BlockHasher(HashAlgorithm algorithm, const std::string& key);

  HashAlgorithm algorithm() const { return algorithm_; }
  // Identity of 0x00 | data.
  Identity digest(const uint8_t* data, size_t len) const;
  // Identity of one block message (parent, tokens, extra bytes).
  Identity block(const Identity& parent, const int64_t* tokens, int64_t num_tokens,
                 const uint8_t* extra, size_t extra_len) const;
  // Chained identities of the complete blocks of `tokens`: out[i] = block(out[i-1], block i),
  // out[-1] = parent. Returns the number of blocks written (num_tokens / T).
  int64_t chain(const int64_t* tokens, int64_t num_tokens, int64_t tokens_per_block,
                Identity parent, Identity* out) const;

 private:
  Identity finish(std::vector<uint8_t>& message) const;

  HashAlgorithm algorithm_;
  // BLAKE2b: chaining state after the key block (or the initial state without a key).
  std::array<uint64_t, 8> b2_start_{};
  bool b2_keyed_ = false;
  // SHA-256: states after the HMAC inner and outer key blocks (or the initial state).
  std::array<uint32_t, 8> sha_inner_{};
  std::array<uint32_t, 8> sha_outer_{};
  bool sha_keyed_ = false;
};

}  // namespace jvmm::jenga
