// `vmm._core.host`: the host VMM backend (memfd + mmap) and its DLPack view factory.
// Every call that runs syscalls releases the GIL; errors arrive in Python as subclasses of
// `HostError` whose args are (message, op, code).
#include "bindings.hpp"

#include <pybind11/stl.h>

#include "host/dlpack_view.hpp"
#include "host/host_vmm.hpp"

namespace py = pybind11;

namespace jvmm {
namespace {

struct HostExceptionTypes {
  PyObject* base;
  PyObject* os;
  PyObject* state;
  PyObject* arg;
  PyObject* range;
  PyObject* vma;
  PyObject* broken;
};
HostExceptionTypes g_types{};

PyObject* new_type(py::module_& m, const char* name, PyObject* base, const char* doc) {
  const std::string full = std::string("vmm._core.host.") + name;
  PyObject* t = PyErr_NewExceptionWithDoc(full.c_str(), doc, base, nullptr);
  if (t == nullptr) throw py::error_already_set();
  Py_INCREF(t);  // kept for the translator for the life of the process
  m.add_object(name, py::handle(t));
  return t;
}

void raise(PyObject* type, const HostError& e) {
  py::tuple args = py::make_tuple(e.what(), e.op, e.code);
  PyErr_SetObject(type, args.ptr());
}

void register_errors(py::module_& m) {
  g_types.base = new_type(m, "HostError", PyExc_Exception, "host backend error");
  g_types.os = new_type(m, "HostOsError", g_types.base, "a syscall failed; code = errno");
  g_types.state = new_type(m, "HostStateError", g_types.base, "slot/handle in the wrong state");
  g_types.arg = new_type(m, "HostArgError", g_types.base, "bad address, size or handle");
  g_types.range = new_type(m, "HostRangeError", g_types.base, "view outside its reservation");
  g_types.vma = new_type(m, "HostVmaError", g_types.base, "VMA budget exceeded");
  g_types.broken =
      new_type(m, "HostBrokenError", g_types.os, "a syscall failed and so did its rollback");
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const HostVmaError& e) {
      raise(g_types.vma, e);
    } catch (const HostRangeError& e) {
      raise(g_types.range, e);
    } catch (const HostArgError& e) {
      raise(g_types.arg, e);
    } catch (const HostStateError& e) {
      raise(g_types.state, e);
    } catch (const HostBrokenError& e) {
      raise(g_types.broken, e);
    } catch (const HostOsError& e) {
      raise(g_types.os, e);
    }
  });
}

void register_vmm(py::module_& m) {
  using Release = py::call_guard<py::gil_scoped_release>;
  py::class_<ViewFactory>(m, "ViewFactory", "DLPack capsules over one reservation")
      .def("capsule", &ViewFactory::capsule, py::arg("offset"), py::arg("shape"),
           py::arg("strides"), py::arg("code"), py::arg("bits"), py::arg("lanes"))
      .def("retire", &ViewFactory::retire, "later capsules raise (the range was freed)")
      .def(
          "share", [](const ViewFactory& self) { return ViewFactory(self); },
          "another factory over the same range (it counts as one more holder)")
      .def_property_readonly("va", &ViewFactory::va)
      .def_property_readonly("size", &ViewFactory::size)
      .def_property_readonly("holders", &ViewFactory::holders);
  py::class_<HostVmm>(m, "HostVmm", "memfd-backed chunks mapped into anonymous reservations")
      .def(py::init<size_t, size_t, int64_t, bool, int>(), py::arg("granularity"),
           py::arg("capacity"), py::arg("vma_budget"), py::arg("collapse") = false,
           py::arg("import_fd") = -1)
      .def("import_handles", &HostVmm::import_handles, py::arg("handles"), Release())
      .def_property_readonly("fd", &HostVmm::fd)
      .def_property_readonly("imported", &HostVmm::imported)
      .def_property_readonly("granularity", &HostVmm::granularity)
      .def_property_readonly("capacity", &HostVmm::capacity)
      .def("create", &HostVmm::create, py::arg("count"), Release())
      .def("release", &HostVmm::release, py::arg("handles"), Release())
      .def("reserve", &HostVmm::reserve, py::arg("size"), py::arg("zero") = false, Release())
      .def("free_reservation", &HostVmm::free_reservation, py::arg("va"), py::arg("size"),
           Release())
      .def("map", &HostVmm::map, py::arg("vas"), py::arg("handles"), Release())
      .def("unmap", &HostVmm::unmap, py::arg("vas"), py::arg("to_zero") = false, Release())
      .def(
          "view_factory",
          [](HostVmm& self, uint64_t va, size_t size) {
            return ViewFactory(self.reservation(va, size), /*device_type=*/1, /*device_id=*/0);
          },
          py::arg("va"), py::arg("size"), Release())
      .def("slot_table", &HostVmm::slot_table, py::arg("va"), py::arg("size"), Release())
      .def("close", &HostVmm::close, Release())
      .def("inject_fault", &HostVmm::inject_fault, py::arg("k"), py::arg("errno_value"),
           py::arg("count") = 1,
           "Make the k-th counted syscall from now and the count-1 after it fail with "
           "errno_value (k <= 0: off).",
           Release())
      // Getters lock the backend's mutex: they wait out a mapping worker without the GIL
      // (pybind11 converts results to Python objects after re-taking it).
      .def_property_readonly("syscalls", py::cpp_function(&HostVmm::syscalls, Release()))
      .def_property_readonly("vmas", py::cpp_function(&HostVmm::vmas, Release()))
      .def_property_readonly("vma_budget", &HostVmm::vma_budget)
      .def_property_readonly("chunks", py::cpp_function(&HostVmm::chunks, Release()))
      .def_property_readonly("physical_bytes",
                             py::cpp_function(&HostVmm::physical_bytes, Release()))
      .def_property_readonly("closed", py::cpp_function(&HostVmm::closed, Release()));
}

}  // namespace

void register_host(py::module_ m) {
  register_errors(m);
  register_vmm(m);
  m.def("device_view_factory", &ViewFactory::over_device, py::arg("va"), py::arg("size"),
        py::arg("device_type"), py::arg("device_id"),
        "DLPack capsules over device memory at [va, va + size) (no mapping kept alive)");
  m.def("process_vmas", &process_vmas, "VMAs held by every HostVmm of the process");
  m.def("process_vma_budget", &process_vma_budget, "shared VMA budget (<= 0: unlimited)");
  m.def("set_process_vma_budget", &set_process_vma_budget, py::arg("budget"),
        "set the VMA budget shared by every HostVmm of the process (<= 0: unlimited)");
}

}  // namespace jvmm
