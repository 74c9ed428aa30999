// `jenga._core`: the allocator core and block hashing. Every call that walks blocks
// releases the GIL (arguments are converted before, results after); C++ never calls Python.
#include "jenga/bindings.hpp"

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <limits>
#include <mutex>
#include <optional>
#include <utility>

#include "jenga/core.hpp"

namespace py = pybind11;

namespace jvmm {

namespace {

using jenga::Core;
using Release = py::call_guard<py::gil_scoped_release>;
using Lock = std::lock_guard<std::mutex>;

// A member function of Core run under the core's API mutex (bound with Release(): the GIL
// is dropped first, so a thread waiting for the mutex never holds the GIL).
template <typename R, typename... A>
auto locked(R (Core::*f)(A...)) {
  return [f](Core& core, A... args) -> R {
    const Lock lock(core.api_mutex());
    return (core.*f)(std::forward<A>(args)...);
  };
}
template <typename R, typename... A>
auto locked(R (Core::*f)(A...) const) {
  return [f](const Core& core, A... args) -> R {
    const Lock lock(core.api_mutex());
    return (core.*f)(std::forward<A>(args)...);
  };
}

// The pending plan as a list of (kind, group, page, reused_units) tuples, the keys of the
// Python op cache (one call, no parallel arrays to zip); an empty list when nothing is pending.
py::list plan_keys(Core& core) {
  py::list out;
  if (core.num_plan_ops() == 0) return out;
  std::vector<jenga::PlanOp> ops;
  {
    py::gil_scoped_release nogil;
    const Lock lock(core.api_mutex());
    ops = core.drain_plan();
  }
  for (const auto& op : ops) {
    out.append(py::make_tuple(static_cast<int32_t>(op.kind), op.group, op.page, op.reused_units));
  }
  return out;
}

py::dict counters_dict(const Core& core) {
  const Lock lock(core.api_mutex());  // with the GIL: the holder never waits for it
  const jenga::Counters& c = core.counters();
  py::dict d;
  for (int s = 1; s <= 5; ++s) d[py::str("alloc.step." + std::to_string(s))] = c.step_blocks[s];
  d["alloc.calls"] = c.alloc_calls;
  d["alloc.failures"] = c.alloc_failures;
  d["alloc.frugal_retries"] = c.frugal_retries;
  d["pages.mapped"] = c.pages_mapped;
  d["pages.unmapped"] = c.pages_unmapped;
  d["pages.evicted"] = c.pages_evicted;
  d["blocks.evicted"] = c.blocks_evicted;
  d["blocks.released"] = c.blocks_released;
  d["blocks.acquired"] = c.blocks_acquired;
  d["plan.remapped_units"] = c.remapped_units;
  d["prefix.hashes_committed"] = c.hashes_committed;
  d["prefix.identity_collisions"] = c.identity_collisions;
  d["prefix.identity_mismatches"] = c.identity_mismatches;
  d["units.free.current"] = core.free_units();
  d["units.evictable.current"] = core.evictable_page_units();
  return d;
}

py::tuple group_counts(const Core& core, int32_t g) {
  const Lock lock(core.api_mutex());
  const jenga::Group& G = core.group(g);
  return py::make_tuple(
      G.num_mapped_pages, G.num_cached_blocks, G.num_free_blocks,
      G.num_mapped_pages * G.blocks_per_page - G.num_cached_blocks - G.num_free_blocks);
}

py::tuple block_info(const Core& core, int32_t g, int32_t b) {
  const Lock lock(core.api_mutex());
  const jenga::Group& G = core.group(g);
  if (b < 0 || static_cast<size_t>(b) >= G.blocks.size()) {
    throw py::index_error("group " + std::to_string(g) + ": block " + std::to_string(b) +
                          " out of range [0, " + std::to_string(G.blocks.size()) + ")");
  }
  const jenga::Block& k = G.blocks[static_cast<size_t>(b)];
  return py::make_tuple(static_cast<int>(k.state), k.refcount, k.hashed, k.last_access,
                        k.prefix_len);
}

using U64Array = py::array_t<uint64_t, py::array::c_style | py::array::forcecast>;
using I64Array = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
using jenga::Identity;
static_assert(sizeof(Identity) == 2 * sizeof(uint64_t), "Identity is two packed words");

// Identities cross the boundary as uint64 arrays of shape (n, 2): (low word, high word).
// A 1-D array of n values is shorthand for the identities (value, 0) (tests of the
// allocation steps name blocks by small integers).
struct Identities {
  const Identity* data = nullptr;
  size_t size = 0;
  std::vector<Identity> owned;
};

Identities identities(const U64Array& a, const char* what) {
  Identities out;
  if (a.ndim() == 1) {
    out.owned.reserve(static_cast<size_t>(a.shape(0)));
    for (py::ssize_t i = 0; i < a.shape(0); ++i) out.owned.push_back({a.data()[i], 0});
    out.data = out.owned.data();
    out.size = out.owned.size();
    return out;
  }
  if (a.ndim() != 2 || a.shape(1) != 2) {
    std::string shape;
    for (py::ssize_t d = 0; d < a.ndim(); ++d)
      shape += (d ? ", " : "") + std::to_string(a.shape(d));
    throw py::value_error(std::string(what) +
                          " must have shape (n, 2) (two uint64 words per "
                          "identity) or (n,), got (" +
                          shape + ")");
  }
  out.data = reinterpret_cast<const Identity*>(a.data());
  out.size = static_cast<size_t>(a.shape(0));
  return out;
}

py::array_t<uint64_t> identity_array(py::ssize_t n) {
  return py::array_t<uint64_t>({n, py::ssize_t{2}});
}

Identity one_identity(const U64Array& a, const char* what) {
  if (a.ndim() != 1 || a.shape(0) != 2) {
    throw py::value_error(std::string(what) + " must be one identity: 2 uint64 words, got " +
                          std::to_string(a.size()) + " values in " + std::to_string(a.ndim()) +
                          " dimension(s)");
  }
  return {a.data()[0], a.data()[1]};
}

py::array_t<uint64_t> to_words(const Identity& id) {
  py::array_t<uint64_t> out(2);
  out.mutable_data()[0] = id.lo;
  out.mutable_data()[1] = id.hi;
  return out;
}

py::array_t<int32_t> lookup(Core& core, int32_t g, const U64Array& hashes) {
  const Identities in = identities(hashes, "hashes");
  py::array_t<int32_t> out(static_cast<py::ssize_t>(in.size));
  int32_t* dst = out.mutable_data();
  {
    py::gil_scoped_release nogil;
    const Lock lock(core.api_mutex());
    core.lookup(g, in.data, in.size, dst);
  }
  return out;
}

int64_t commit(Core& core, int32_t g, const std::vector<int32_t>& blocks, const U64Array& hashes,
               const std::vector<int64_t>& prefix_lens) {
  const Identities h = identities(hashes, "hashes");
  const std::vector<Identity> ids(h.data, h.data + h.size);
  py::gil_scoped_release nogil;
  const Lock lock(core.api_mutex());
  return core.commit(g, blocks, ids, prefix_lens);
}

int64_t commit_run(Core& core, int32_t g,
                   const py::array_t<int32_t, py::array::c_style | py::array::forcecast>& arr,
                   const U64Array& hashes, int64_t first_prefix, int64_t step) {
  if (arr.ndim() != 1) throw py::value_error("blocks must be 1-D");
  const std::vector<int32_t> blocks(arr.data(), arr.data() + arr.shape(0));
  const Identities h = identities(hashes, "hashes");
  if (h.size != blocks.size()) {
    throw py::value_error("commit_run needs one hash per block: " + std::to_string(blocks.size()) +
                          " blocks, " + std::to_string(h.size) + " hashes");
  }
  py::gil_scoped_release nogil;
  const Lock lock(core.api_mutex());
  return core.commit_run(g, blocks, h.data, first_prefix, step);
}

// ---- block identity (digest.hpp) ------------------------------------------------------

jenga::HashAlgorithm algorithm_named(const std::string& name) {
  if (name == "blake2b") return jenga::HashAlgorithm::kBlake2b;
  if (name == "sha256") return jenga::HashAlgorithm::kSha256;
  throw py::value_error("unknown hash algorithm '" + name + "'; known: 'blake2b', 'sha256'");
}

const uint8_t* bytes_of(const std::string& s) { return reinterpret_cast<const uint8_t*>(s.data()); }

py::array_t<uint64_t> hasher_chain(const jenga::BlockHasher& h, const I64Array& tokens,
                                   int64_t tokens_per_block, const U64Array& parent) {
  if (tokens.ndim() != 1) {
    throw py::value_error("tokens must be 1-D, got " + std::to_string(tokens.ndim()));
  }
  if (tokens_per_block <= 0) {
    throw py::value_error("tokens_per_block must be > 0, got " + std::to_string(tokens_per_block));
  }
  const Identity root = one_identity(parent, "parent");
  const int64_t n = tokens.shape(0);
  auto out = identity_array(n / tokens_per_block);
  Identity* dst = reinterpret_cast<Identity*>(out.mutable_data());
  const int64_t* src = tokens.data();
  {
    py::gil_scoped_release nogil;
    h.chain(src, n, tokens_per_block, root, dst);
  }
  return out;
}

py::array_t<uint64_t> hasher_block(const jenga::BlockHasher& h, const U64Array& parent,
                                   const I64Array& tokens, const py::bytes& extra) {
  if (tokens.ndim() != 1) {
    throw py::value_error("tokens must be 1-D, got " + std::to_string(tokens.ndim()));
  }
  const std::string more = extra;
  return to_words(h.block(one_identity(parent, "parent"), tokens.data(), tokens.shape(0),
                          bytes_of(more), more.size()));
}

void register_identity(py::module_ m) {
  py::class_<jenga::BlockHasher>(m, "BlockHasher",
                                 "128-bit block identities: keyed BLAKE2b-128 or (HMAC-)SHA-256 "
                                 "cut to 128 bits (csrc/jenga/digest.hpp)")
      .def(py::init([](const std::string& algorithm, const py::bytes& key) {
             return jenga::BlockHasher(algorithm_named(algorithm), key);
           }),
           py::arg("algorithm"), py::arg("key"))
      .def(
          "digest",
          [](const jenga::BlockHasher& h, const py::bytes& data) {
            const std::string s = data;
            return to_words(h.digest(bytes_of(s), s.size()));
          },
          py::arg("data"), "Identity (2 uint64 words) of the message 0x00 | data")
      .def("block", &hasher_block, py::arg("parent"), py::arg("tokens"),
           py::arg("extra") = py::bytes(),
           "Identity of one block: parent identity, its tokens, extra bytes (image keys)")
      .def("chain", &hasher_chain, py::arg("tokens"), py::arg("tokens_per_block"),
           py::arg("parent"),
           "Chained identities (n, 2) of the complete blocks of `tokens` after `parent`");
  m.def(
      "blake2b",
      [](const py::bytes& data, const py::bytes& key, size_t digest_size) {
        const std::string s = data, k = key;
        const auto d = jenga::blake2b(bytes_of(s), s.size(), k, digest_size);
        return py::bytes(reinterpret_cast<const char*>(d.data()), d.size());
      },
      py::arg("data"), py::arg("key") = py::bytes(), py::arg("digest_size") = 64,
      "BLAKE2b of data (RFC 7693), keyed when key is not empty");
  m.def(
      "sha256",
      [](const py::bytes& data, const py::bytes& key) {
        const std::string s = data, k = key;
        const auto d = jenga::sha256(bytes_of(s), s.size(), k);
        return py::bytes(reinterpret_cast<const char*>(d.data()), d.size());
      },
      py::arg("data"), py::arg("key") = py::bytes(),
      "SHA-256 of data, HMAC-SHA-256 when key is not empty");
}

using I32Array = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;

std::vector<int32_t> to_vector(const I32Array& a) {
  if (a.ndim() != 1) throw py::value_error("blocks must be 1-D, got " + std::to_string(a.ndim()));
  return std::vector<int32_t>(a.data(), a.data() + a.shape(0));
}

py::array_t<int32_t> to_array(const std::vector<int32_t>& v) {
  py::array_t<int32_t> out(static_cast<py::ssize_t>(v.size()));
  std::copy(v.begin(), v.end(), out.mutable_data());
  return out;
}

// allocate() with int32 arrays in and out: one memcpy per group instead of an int object
// per block (the engine-facing API keeps block tables in arrays too).
py::object allocate_arrays(Core& core, int64_t owner, const std::vector<int32_t>& counts,
                           int64_t now, const std::vector<I32Array>& releases) {
  std::vector<std::vector<int32_t>> rel;
  rel.reserve(releases.size());
  for (const I32Array& r : releases) rel.push_back(to_vector(r));
  std::optional<std::vector<std::vector<int32_t>>> got;
  {
    py::gil_scoped_release nogil;
    const Lock lock(core.api_mutex());
    got = core.allocate(owner, counts, now, rel);
  }
  if (!got) return py::none();
  py::list out;
  for (const auto& blocks : *got) out.append(to_array(blocks));
  return out;
}

// Calls on fewer blocks keep the GIL: dropping and retaking it costs more than the work.
// (Safe with the API mutex: no holder of the mutex ever waits for the GIL.)
constexpr size_t kReleaseGilAt = 4096;

// Block ids of a Python list or tuple of ints, or of anything numpy reads as 1-D int32;
// a list or an int32 buffer is read without building an array.
struct BlockIds {
  const int32_t* data = nullptr;
  size_t size = 0;
  std::vector<int32_t>& scratch;
  I32Array array;
};

int32_t block_id(PyObject* item, size_t i) {
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
  if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
  if (overflow != 0 || v < std::numeric_limits<int32_t>::min() ||
      v > std::numeric_limits<int32_t>::max()) {
    throw py::value_error("blocks[" + std::to_string(i) +
                          "] = " + py::str(item).cast<std::string>() + " is not an int32 block id");
  }
  return static_cast<int32_t>(v);
}

// A 1-D, C-contiguous buffer of int32 (numpy int32, array.array('i')), read or written in
// place; `ok` is false (no error set) for any other object.
struct Int32Buffer {
  Py_buffer view{};
  bool ok = false;
  Int32Buffer(PyObject* obj, bool writable) {
    const int flags = PyBUF_FORMAT | PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (!PyObject_CheckBuffer(obj) || PyObject_GetBuffer(obj, &view, flags) != 0) {
      PyErr_Clear();
      return;
    }
    const char* f = view.format == nullptr ? "B" : view.format;
    if (f[0] == '<' || f[0] == '=' || f[0] == '@') ++f;
    ok = view.ndim == 1 && view.itemsize == 4 && (f[0] == 'i' || f[0] == 'l') && f[1] == 0;
    if (!ok) PyBuffer_Release(&view);
  }
  ~Int32Buffer() {
    if (ok) PyBuffer_Release(&view);
  }
  Int32Buffer(const Int32Buffer&) = delete;
  Int32Buffer& operator=(const Int32Buffer&) = delete;
  int32_t* data() const { return static_cast<int32_t*>(view.buf); }
  size_t size() const { return static_cast<size_t>(view.shape[0]); }
};

void read_ids(BlockIds& ids, py::handle blocks) {
  PyObject* obj = blocks.ptr();
  const Int32Buffer buf(obj, false);
  if (buf.ok) {  // copied: the buffer is released before the core runs
    ids.scratch.assign(buf.data(), buf.data() + buf.size());
    ids.data = ids.scratch.data();
    ids.size = ids.scratch.size();
    return;
  }
  if (PyList_Check(obj) || PyTuple_Check(obj)) {
    const size_t n = static_cast<size_t>(PySequence_Fast_GET_SIZE(obj));
    PyObject** items = PySequence_Fast_ITEMS(obj);
    ids.scratch.resize(n);
    for (size_t i = 0; i < n; ++i) ids.scratch[i] = block_id(items[i], i);
    ids.data = ids.scratch.data();
    ids.size = n;
    return;
  }
  ids.array = I32Array::ensure(blocks);
  if (!ids.array) throw py::error_already_set();
  if (ids.array.ndim() != 1) {
    throw py::value_error("blocks must be 1-D, got " + std::to_string(ids.array.ndim()));
  }
  ids.data = ids.array.data();
  ids.size = static_cast<size_t>(ids.array.shape(0));
}

void release_array(Core& core, int32_t g, py::handle blocks, int64_t now) {
  thread_local std::vector<int32_t> scratch;
  BlockIds ids{nullptr, 0, scratch, {}};
  read_ids(ids, blocks);
  std::optional<py::gil_scoped_release> nogil;
  if (ids.size >= kReleaseGilAt) nogil.emplace();
  const Lock lock(core.api_mutex());
  core.release(g, ids.data, ids.size, now);
}

// allocate() of `count` blocks in one group, the ids as a list of ints (None: no room,
// nothing changed): one call, no array, the core's buffers reused.
// With `out` (a writable 1-D int32 buffer, numpy or array.array, of at least `count`
// entries) the ids go to out[:count] and the call returns count (None: no room, out
// untouched).
py::object allocate_blocks(Core& core, int32_t g, int32_t count, int64_t owner, int64_t now,
                           py::handle out_buffer) {
  thread_local std::vector<int32_t> got;
  std::optional<Int32Buffer> dst;
  if (!out_buffer.is_none()) {
    dst.emplace(out_buffer.ptr(), true);
    if (!dst->ok) {
      throw py::type_error("out must be a writable, C-contiguous 1-D int32 buffer, got " +
                           py::repr(out_buffer).cast<std::string>().substr(0, 80));
    }
    if (count > 0 && dst->size() < static_cast<size_t>(count)) {
      throw py::value_error("out holds " + std::to_string(dst->size()) + " block ids, " +
                            std::to_string(count) + " requested");
    }
  }
  bool ok = false;
  {
    std::optional<py::gil_scoped_release> nogil;
    if (count >= 0 && static_cast<size_t>(count) >= kReleaseGilAt) nogil.emplace();
    const Lock lock(core.api_mutex());
    ok = core.allocate_one(g, owner, count, now, got);
  }
  if (!ok) return py::none();
  if (dst) {
    std::copy(got.begin(), got.end(), dst->data());
    return py::int_(got.size());
  }
  PyObject* out = PyList_New(static_cast<py::ssize_t>(got.size()));
  if (out == nullptr) throw py::error_already_set();
  for (size_t i = 0; i < got.size(); ++i) {
    PyList_SET_ITEM(out, static_cast<py::ssize_t>(i), PyLong_FromLong(got[i]));
  }
  return py::reinterpret_steal<py::object>(out);
}

void acquire_array(Core& core, int32_t g, const I32Array& blocks, int64_t now) {
  std::vector<int32_t> v = to_vector(blocks);
  py::gil_scoped_release nogil;
  const Lock lock(core.api_mutex());
  core.acquire(g, v, now);
}

// `jenga._core.Rules` from JENGA_RULES (core.hpp): read-only fields and a keyword constructor
// (a rule not given keeps its default; an unknown keyword is a TypeError).
void register_rules(py::module_ m) {
  using jenga::AllocationOrder;
  using jenga::Rules;
  py::enum_<AllocationOrder>(m, "AllocationOrder", "order of the five allocation steps")
      .value("PAPER", AllocationOrder::kPaper)
      .value("COMPACT", AllocationOrder::kCompact)
      .value("PINNED", AllocationOrder::kPinned);
  py::class_<Rules> rules(m, "Rules", "The rules the core allocates and evicts by (one value)");
  rules.def(py::init([](const py::kwargs& kwargs) {
    Rules r;
    py::list unknown = kwargs.attr("keys")();
#define JENGA_RULE_FROM_KWARGS(type, name, init, doc) \
  if (kwargs.contains(#name)) {                       \
    r.name = kwargs[#name].cast<type>();              \
    unknown.attr("remove")(#name);                    \
  }
    JENGA_RULES(JENGA_RULE_FROM_KWARGS)
#undef JENGA_RULE_FROM_KWARGS
    if (!unknown.empty()) {
      throw py::type_error("Rules got unknown rules " + py::str(unknown).cast<std::string>());
    }
    return r;
  }));
#define JENGA_RULE_BINDING(type, name, init, doc) rules.def_readonly(#name, &Rules::name, doc);
  JENGA_RULES(JENGA_RULE_BINDING)
#undef JENGA_RULE_BINDING
}

// Core's rules, checks and introspection (register_jenga defines its operations).
void def_core_state(py::class_<Core>& cls) {
  cls.def_property(
         "rules",
         [](const Core& core) -> jenga::Rules {
           const Lock lock(core.api_mutex());
           return core.rules();  // a copy, taken under the lock
         },
         locked(&Core::set_rules), "The rules (a copy; assign a new Rules to change them)")
      .def("check_invariants", locked(&Core::check_invariants), py::arg("expensive") = false,
           Release())
      .def("eviction_order", locked(&Core::eviction_order), py::arg("group"), Release())
      .def("page_eviction_order", locked(&Core::page_eviction_order), Release())
      .def("counters", &counters_dict)
      .def("group_counts", &group_counts, py::arg("group"),
           "(mapped_pages, cached_blocks, free_blocks, used_blocks)")
      .def("block_info", &block_info, py::arg("group"), py::arg("block"),
           "(state 0 free/1 used/2 cached, refcount, hashed, last_access, prefix_len)")
      .def_property_readonly("total_units", locked(&Core::total_units))
      .def_property_readonly("free_units", locked(&Core::free_units))
      .def_property_readonly("num_groups", &Core::num_groups)
      .def_property_readonly("record_plan", &Core::record_plan)
      .def("memory_bytes", locked(&Core::memory_bytes), Release(),
           "Bytes the core holds (its containers' capacities; set nodes estimated)");
}

}  // namespace

void register_jenga(py::module_ m) {
  register_rules(m);
  register_identity(m);
  py::class_<Core> core(m, "Core", "Two-level LCM allocator bookkeeping (see jenga/allocator.py)");
  core.def(py::init<const std::vector<int32_t>&, const std::vector<int32_t>&, int64_t,
                    const jenga::Rules&, int32_t, bool>(),
           py::arg("blocks_per_page"), py::arg("units_per_page"), py::arg("total_units"),
           py::arg_v("rules", jenga::Rules{}, "Rules()"), py::arg("short_key_bits") = 64,
           py::arg("record_plan") = true,
           "short_key_bits < 64 keys the hash index by fewer bits of each identity (a test "
           "hook: collisions of the short key are then common, and must never be served); "
           "record_plan=False keeps no plan ops (nothing maps pages; drain_plan() is empty)")
      .def("allocate", locked(&Core::allocate), py::arg("owner"), py::arg("counts"), py::arg("now"),
           py::arg("releases") = std::vector<std::vector<int32_t>>{}, Release())
      .def("allocate_arrays", &allocate_arrays, py::arg("owner"), py::arg("counts"), py::arg("now"),
           py::arg("releases") = std::vector<I32Array>{},
           "allocate() taking and returning int32 arrays")
      .def("evict_cached_pages", &Core::evict_cached_pages, py::arg("units"), Release(),
           "Evict whole evictable pages in step 3's order until `units` units are freed or "
           "none is left; returns the units freed (the unmaps are plan ops)")
      .def("uncache_blocks", locked(&Core::uncache_blocks), py::arg("group"), py::arg("blocks"),
           Release(),
           "Drop these blocks of a group from the prefix cache (bad data): cached ones turn "
           "free (pages left empty are unmapped: plan ops), used ones lose their hash; "
           "returns how many left the index")
      .def("set_total_units", locked(&Core::set_total_units), py::arg("units"), Release(),
           "Grow or shrink the pool to `units` units; a shrink takes free units only "
           "(ValueError, nothing changed, when fewer are free)")
      .def("allocate_blocks", &allocate_blocks, py::arg("group"), py::arg("count"),
           py::arg("owner"), py::arg("now"), py::arg("out") = py::none(),
           "allocate() of `count` blocks in one group: a list of block ids, or None (no room, "
           "nothing changed); with `out` (writable 1-D int32 buffer) the ids go to "
           "out[:count] and the call returns count")
      .def("release", &release_array, py::arg("group"), py::arg("blocks"), py::arg("now"),
           "Drop one reference per block (a list/tuple of ints or a 1-D int32 array), last "
           "listed first; ValueError (nothing changed) if one is not in use")
      .def("acquire", &acquire_array, py::arg("group"), py::arg("blocks"), py::arg("now"))
      .def("commit", &commit, py::arg("group"), py::arg("blocks"), py::arg("hashes"),
           py::arg("prefix_lens"), "Enter the identities (n, 2) of USED blocks in the index")
      .def("commit_run", &commit_run, py::arg("group"), py::arg("blocks"), py::arg("hashes"),
           py::arg("first_prefix"), py::arg("step"),
           "commit() for consecutive blocks: prefix_len[i] = first_prefix + i * step; "
           "negative block ids are skipped")
      .def("lookup", &lookup, py::arg("group"), py::arg("hashes"),
           "Block id per identity (int32 array), -1 where absent or where the short key "
           "names another identity")
      .def("drain_plan", &plan_keys,
           "The plan ops since the last drain as (kind 0 map / 1 unmap, group, page, "
           "reused_units) tuples");
  def_core_state(core);
}

}  // namespace jvmm
