// `vmm._core.bench`: raw baselines that vmm-bench measures side by side with the vmm layer.
#include "bindings.hpp"

#include <pybind11/stl.h>

#include "bench/raw_dlpack.hpp"
#include "bench/raw_host.hpp"

namespace py = pybind11;

namespace jvmm {

void register_bench(py::module_ m) {
  m.def("raw_host_cycle", &bench::raw_host_cycle, py::arg("chunk_size"), py::arg("order"),
        py::call_guard<py::gil_scoped_release>(),
        "One pool's life in plain syscalls, each timed in C++: returns {op: [ns per call]} "
        "for pool, create, reserve, map, unmap, release, free_reservation. `order[i]` is the "
        "memfd chunk mapped at slot i (distinct, >= 0).");
  m.def("raw_host_map_rounds", &bench::raw_host_map_rounds, py::arg("chunk_size"), py::arg("order"),
        py::arg("rounds"), py::call_guard<py::gil_scoped_release>(),
        "Only map and unmap, each slot one by one, `rounds` times over one populated memfd "
        "and one reservation (set up untimed): {'map': [ns...], 'unmap': [ns...]}.");
  m.def("raw_view_capsule", &bench::raw_view_capsule, py::arg("addr"), py::arg("nbytes"),
        py::arg("cuda_device") = -1,
        "A bare 'dltensor' capsule of `nbytes` uint8 at `addr` (CPU, or CUDA device N); "
        "it does not keep the memory alive.");
}

}  // namespace jvmm
