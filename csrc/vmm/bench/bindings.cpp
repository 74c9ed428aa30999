// `vmm._core.bench`: raw baselines that vmm-bench measures side by side with the vmm layer.
#include "bindings.hpp"

#include <pybind11/stl.h>

#include "bench/raw_dlpack.hpp"
#include "bench/raw_host.hpp"

namespace py = pybind11;

namespace jvmm {

void register_bench(py::module_ m) {
  // Docstrings stay one short line: the generated stubs keep them on one line.
  m.def("raw_host_cycle", &bench::raw_host_cycle, py::arg("chunk_size"), py::arg("order"),
        py::call_guard<py::gil_scoped_release>(),
        "ns per call of each syscall of one pool's life (see raw_host.hpp).");
  m.def("raw_host_map_rounds", &bench::raw_host_map_rounds, py::arg("chunk_size"), py::arg("order"),
        py::arg("rounds"), py::call_guard<py::gil_scoped_release>(),
        "ns per map and unmap call, `rounds` passes over chunks set up once.");
  m.def("raw_view_capsule", &bench::raw_view_capsule, py::arg("addr"), py::arg("nbytes"),
        py::arg("cuda_device") = -1, "A bare uint8 'dltensor' capsule at addr (owns nothing).");
}

}  // namespace jvmm
