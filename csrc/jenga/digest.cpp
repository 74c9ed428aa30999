// BLAKE2b (RFC 7693), SHA-256 (FIPS 180-4), HMAC-SHA-256 (RFC 2104) and the block hasher
// built on them; the design note is in digest.hpp. Written from the specifications; the
// tests compare every function with Python's hashlib and hmac on random inputs.
#include "jenga/digest.hpp"

#include <cstring>
#include <stdexcept>
#include <tuple>
#include <utility>

namespace jvmm::jenga {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "digest.cpp assumes a little-endian host");

namespace {

// ---- BLAKE2b ------------------------------------------------------------------------------

constexpr size_t kB2Block = 128;
constexpr std::array<uint64_t, 8> kB2Iv = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
    0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL, 0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL};
constexpr uint8_t kSigma[12][16] = {{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
                                    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
                                    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
                                    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
                                    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
                                    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
                                    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
                                    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
                                    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
                                    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
                                    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
                                    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3}};

using B2State = std::array<uint64_t, 8>;

inline uint64_t rotr64(uint64_t x, int r) { return (x >> r) | (x << (64 - r)); }

inline uint64_t load_le64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

inline void b2_mix(uint64_t* v, int a, int b, int c, int d, uint64_t x, uint64_t y) {
  v[a] = v[a] + v[b] + x;
  v[d] = rotr64(v[d] ^ v[a], 32);
  v[c] = v[c] + v[d];
  v[b] = rotr64(v[b] ^ v[c], 24);
  v[a] = v[a] + v[b] + y;
  v[d] = rotr64(v[d] ^ v[a], 16);
  v[c] = v[c] + v[d];
  v[b] = rotr64(v[b] ^ v[c], 63);
}

// One round r, its message schedule kSigma[r] known at compile time (fully unrolled).
template <size_t r>
inline void b2_round(uint64_t* v, const uint64_t* m) {
  constexpr const uint8_t* s = kSigma[r];
  b2_mix(v, 0, 4, 8, 12, m[s[0]], m[s[1]]);
  b2_mix(v, 1, 5, 9, 13, m[s[2]], m[s[3]]);
  b2_mix(v, 2, 6, 10, 14, m[s[4]], m[s[5]]);
  b2_mix(v, 3, 7, 11, 15, m[s[6]], m[s[7]]);
  b2_mix(v, 0, 5, 10, 15, m[s[8]], m[s[9]]);
  b2_mix(v, 1, 6, 11, 12, m[s[10]], m[s[11]]);
  b2_mix(v, 2, 7, 8, 13, m[s[12]], m[s[13]]);
  b2_mix(v, 3, 4, 9, 14, m[s[14]], m[s[15]]);
}

template <size_t... r>
inline void b2_rounds(uint64_t* v, const uint64_t* m, std::index_sequence<r...>) {
  (b2_round<r>(v, m), ...);
}

// F: compress one 128-byte block; `count` is the byte counter after this block.
void b2_compress(B2State& h, const uint8_t* block, uint64_t count, bool last) {
  uint64_t m[16];
  for (int i = 0; i < 16; ++i) m[i] = load_le64(block + 8 * i);
  uint64_t v[16];
  for (int i = 0; i < 8; ++i) {
    v[i] = h[static_cast<size_t>(i)];
    v[i + 8] = kB2Iv[static_cast<size_t>(i)];
  }
  v[12] ^= count;  // the counter's high word stays 0: messages are far below 2^64 bytes
  if (last) v[14] = ~v[14];
  b2_rounds(v, m, std::make_index_sequence<12>{});
  for (int i = 0; i < 8; ++i) h[static_cast<size_t>(i)] ^= v[i] ^ v[i + 8];
}

// The initial state for a key length and digest size (parameter block: fanout 1, depth 1).
B2State b2_init(size_t key_len, size_t digest_size) {
  B2State h = kB2Iv;
  h[0] ^= 0x01010000ULL ^ (static_cast<uint64_t>(key_len) << 8) ^ digest_size;
  return h;
}

// Absorb `data` (the rest of the message) after `count` bytes, ending with the final block.
void b2_finish(B2State& h, uint64_t count, const uint8_t* data, size_t len) {
  while (len > kB2Block) {
    count += kB2Block;
    b2_compress(h, data, count, false);
    data += kB2Block;
    len -= kB2Block;
  }
  uint8_t last[kB2Block] = {};
  if (len) std::memcpy(last, data, len);
  b2_compress(h, last, count + len, true);
}

// ---- SHA-256 ------------------------------------------------------------------------------

constexpr size_t kShaBlock = 64;
using ShaState = std::array<uint32_t, 8>;

struct ShaConstants {
  std::array<uint32_t, 64> k{};
  ShaState h0{};
};

// floor(x^(1/root)) for x < 2^106, by bisection (root 2 or 3; results below 2^40).
uint64_t int_root(unsigned __int128 x, int root) {
  uint64_t lo = 0, hi = uint64_t{1} << 40;
  while (hi - lo > 1) {
    const uint64_t mid = lo + (hi - lo) / 2;
    unsigned __int128 p = mid;
    for (int i = 1; i < root; ++i) p *= mid;
    (p <= x ? lo : hi) = mid;
  }
  return lo;
}

// The constants by their definition: the first 32 fractional bits of the cube roots
// (K) and square roots (H0) of the first 64 (8) primes.
ShaConstants make_sha_constants() {
  ShaConstants c;
  int found = 0;
  for (uint32_t p = 2; found < 64; ++p) {
    bool prime = true;
    for (uint32_t d = 2; d * d <= p; ++d) prime = prime && (p % d != 0);
    if (!prime) continue;
    const auto x = static_cast<unsigned __int128>(p);
    c.k[static_cast<size_t>(found)] = static_cast<uint32_t>(int_root(x << 96, 3));
    if (found < 8) c.h0[static_cast<size_t>(found)] = static_cast<uint32_t>(int_root(x << 64, 2));
    ++found;
  }
  return c;
}

const ShaConstants& sha_constants() {
  static const ShaConstants c = make_sha_constants();
  return c;
}

inline uint32_t rotr32(uint32_t x, int r) { return (x >> r) | (x << (32 - r)); }

void sha_compress(ShaState& h, const uint8_t* block) {
  const auto& k = sha_constants().k;
  uint32_t w[64];
  for (int i = 0; i < 16; ++i) {
    const uint8_t* p = block + 4 * i;
    w[i] = (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | p[3];
  }
  for (int i = 16; i < 64; ++i) {
    const uint32_t s0 = rotr32(w[i - 15], 7) ^ rotr32(w[i - 15], 18) ^ (w[i - 15] >> 3);
    const uint32_t s1 = rotr32(w[i - 2], 17) ^ rotr32(w[i - 2], 19) ^ (w[i - 2] >> 10);
    w[i] = w[i - 16] + s0 + w[i - 7] + s1;
  }
  uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], hh = h[7];
  for (size_t i = 0; i < 64; ++i) {
    const uint32_t t1 =
        hh + (rotr32(e, 6) ^ rotr32(e, 11) ^ rotr32(e, 25)) + ((e & f) ^ (~e & g)) + k[i] + w[i];
    const uint32_t t2 =
        (rotr32(a, 2) ^ rotr32(a, 13) ^ rotr32(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
    hh = g;
    g = f;
    f = e;
    e = d + t1;
    d = c;
    c = b;
    b = a;
    a = t1 + t2;
  }
  const uint32_t out[8] = {a, b, c, d, e, f, g, hh};
  for (size_t i = 0; i < 8; ++i) h[i] += out[i];
}

// Absorb the rest of a message after `count` bytes (a multiple of 64), pad, and return
// the 32-byte digest.
std::array<uint8_t, 32> sha_finish(ShaState h, uint64_t count, const uint8_t* data, size_t len) {
  for (; len >= kShaBlock; data += kShaBlock, len -= kShaBlock, count += kShaBlock) {
    sha_compress(h, data);
  }
  uint8_t tail[2 * kShaBlock] = {};
  if (len) std::memcpy(tail, data, len);
  tail[len] = 0x80;
  const size_t n = len + 9 <= kShaBlock ? kShaBlock : 2 * kShaBlock;
  const uint64_t bits = (count + len) * 8;
  for (size_t i = 0; i < 8; ++i) tail[n - 1 - i] = static_cast<uint8_t>(bits >> (8 * i));
  for (size_t off = 0; off < n; off += kShaBlock) sha_compress(h, tail + off);
  std::array<uint8_t, 32> out{};
  for (size_t i = 0; i < 32; ++i) out[i] = static_cast<uint8_t>(h[i / 4] >> (24 - 8 * (i % 4)));
  return out;
}

// HMAC's inner and outer states: the initial state after the key padded to 64 bytes,
// XORed with 0x36 (inner) and 0x5c (outer); a longer key is hashed first.
std::pair<ShaState, ShaState> hmac_states(const std::string& key) {
  const ShaState h0 = sha_constants().h0;
  uint8_t k[kShaBlock] = {};
  if (key.size() > kShaBlock) {
    const auto d = sha_finish(h0, 0, reinterpret_cast<const uint8_t*>(key.data()), key.size());
    std::memcpy(k, d.data(), d.size());
  } else if (!key.empty()) {
    std::memcpy(k, key.data(), key.size());
  }
  uint8_t pad[kShaBlock];
  ShaState inner = h0, outer = h0;
  for (size_t i = 0; i < kShaBlock; ++i) pad[i] = k[i] ^ 0x36;
  sha_compress(inner, pad);
  for (size_t i = 0; i < kShaBlock; ++i) pad[i] = k[i] ^ 0x5c;
  sha_compress(outer, pad);
  return {inner, outer};
}

std::array<uint8_t, 32> hmac_finish(const ShaState& inner, const ShaState& outer,
                                    const uint8_t* data, size_t len) {
  const auto in = sha_finish(inner, kShaBlock, data, len);
  return sha_finish(outer, kShaBlock, in.data(), in.size());
}

Identity identity_of(const uint8_t* digest) { return {load_le64(digest), load_le64(digest + 8)}; }

}  // namespace

std::vector<uint8_t> blake2b(const uint8_t* data, size_t len, const std::string& key,
                             size_t digest_size) {
  if (key.size() > 64 || digest_size == 0 || digest_size > 64) {
    throw std::invalid_argument(
        "blake2b takes a key of <= 64 bytes and a digest of 1..64 bytes, "
        "got " +
        std::to_string(key.size()) + " and " + std::to_string(digest_size));
  }
  B2State h = b2_init(key.size(), digest_size);
  uint64_t count = 0;
  if (!key.empty()) {
    uint8_t block[kB2Block] = {};
    std::memcpy(block, key.data(), key.size());
    count = kB2Block;
    b2_compress(h, block, count, len == 0);
  }
  if (len || key.empty()) b2_finish(h, count, data, len);
  std::vector<uint8_t> out(digest_size);
  std::memcpy(out.data(), h.data(), digest_size);
  return out;
}

std::vector<uint8_t> sha256(const uint8_t* data, size_t len, const std::string& key) {
  std::array<uint8_t, 32> d;
  if (key.empty()) {
    d = sha_finish(sha_constants().h0, 0, data, len);
  } else {
    const auto [inner, outer] = hmac_states(key);
    d = hmac_finish(inner, outer, data, len);
  }
  return std::vector<uint8_t>(d.begin(), d.end());
}

BlockHasher::BlockHasher(HashAlgorithm algorithm, const std::string& key) : algorithm_(algorithm) {
  if (algorithm == HashAlgorithm::kBlake2b) {
    if (key.size() > 64) {
      throw std::invalid_argument("a blake2b key has at most 64 bytes, got " +
                                  std::to_string(key.size()));
    }
    b2_start_ = b2_init(key.size(), 16);
    b2_keyed_ = !key.empty();
    if (b2_keyed_) {  // every message is non-empty, so the key block is never the last
      uint8_t block[kB2Block] = {};
      std::memcpy(block, key.data(), key.size());
      b2_compress(b2_start_, block, kB2Block, false);
    }
  } else if (algorithm == HashAlgorithm::kSha256) {
    sha_keyed_ = !key.empty();
    if (sha_keyed_) {
      std::tie(sha_inner_, sha_outer_) = hmac_states(key);
    } else {
      sha_inner_ = sha_constants().h0;
    }
  } else {
    throw std::invalid_argument("unknown hash algorithm " +
                                std::to_string(static_cast<int32_t>(algorithm)));
  }
}

Identity BlockHasher::finish(std::vector<uint8_t>& message) const {
  if (algorithm_ == HashAlgorithm::kBlake2b) {
    B2State h = b2_start_;
    b2_finish(h, b2_keyed_ ? kB2Block : 0, message.data(), message.size());
    return {h[0], h[1]};
  }
  const auto d = sha_keyed_ ? hmac_finish(sha_inner_, sha_outer_, message.data(), message.size())
                            : sha_finish(sha_inner_, 0, message.data(), message.size());
  return identity_of(d.data());
}

Identity BlockHasher::digest(const uint8_t* data, size_t len) const {
  std::vector<uint8_t> message;
  message.reserve(len + 1);
  message.push_back(0x00);
  message.insert(message.end(), data, data + len);
  return finish(message);
}

namespace {

// The block message (digest.hpp), written in place (the host is little-endian).
void block_message(std::vector<uint8_t>& m, const Identity& parent, const int64_t* tokens,
                   int64_t n, const uint8_t* extra, size_t extra_len) {
  uint64_t high = 0;
  for (int64_t j = 0; j < n; ++j) high |= static_cast<uint64_t>(tokens[j]) >> 32;
  const size_t width = high == 0 ? 4 : 8;
  const size_t count = static_cast<size_t>(n);
  m.resize(18 + width * count + extra_len);
  uint8_t* p = m.data();
  p[0] = 0x01;
  std::memcpy(p + 1, &parent.lo, 8);
  std::memcpy(p + 9, &parent.hi, 8);
  p[17] = static_cast<uint8_t>(width);
  p += 18;
  if (width == 8) {
    std::memcpy(p, tokens, 8 * count);
  } else {
    for (size_t j = 0; j < count; ++j) {
      const auto v = static_cast<uint32_t>(tokens[j]);
      std::memcpy(p + 4 * j, &v, 4);
    }
  }
  if (extra_len) std::memcpy(p + width * count, extra, extra_len);
}

}  // namespace

Identity BlockHasher::block(const Identity& parent, const int64_t* tokens, int64_t num_tokens,
                            const uint8_t* extra, size_t extra_len) const {
  std::vector<uint8_t> message;
  message.reserve(18 + 8 * static_cast<size_t>(num_tokens) + extra_len);
  block_message(message, parent, tokens, num_tokens, extra, extra_len);
  return finish(message);
}

int64_t BlockHasher::chain(const int64_t* tokens, int64_t num_tokens, int64_t tokens_per_block,
                           Identity parent, Identity* out) const {
  if (tokens_per_block <= 0) {
    throw std::invalid_argument("tokens_per_block must be > 0, got " +
                                std::to_string(tokens_per_block));
  }
  const int64_t num_blocks = num_tokens / tokens_per_block;
  std::vector<uint8_t> message;
  message.reserve(18 + 8 * static_cast<size_t>(tokens_per_block));
  for (int64_t i = 0; i < num_blocks; ++i) {
    block_message(message, parent, tokens + i * tokens_per_block, tokens_per_block, nullptr, 0);
    parent = finish(message);
    out[i] = parent;
  }
  return num_blocks;
}

}  // namespace jvmm::jenga
