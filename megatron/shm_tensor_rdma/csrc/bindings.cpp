// pybind11 bindings of the engine. Arguments are checked in the engine and surface here as
// ValueError (bad argument), _C.TransportError, or _C.PeerSetupError(message, peer_rank); the
// typed wrapper in megatron/shm_tensor_rdma turns those into its public exceptions. Every
// call that can wait releases the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "engine.h"
#include "shm_transport.h"
#include "verbs_logic.h"
#include "verbs_transport.h"

namespace py = pybind11;
using namespace strdma;

namespace {

py::tuple finished_tuple(const Finished& f) { return py::make_tuple(f.id, f.state, f.error_kind, f.message); }

py::list finished_list(const std::vector<Finished>& v) {
  py::list out;
  for (auto& f : v) out.append(finished_tuple(f));
  return out;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "C++ core of megatron.shm_tensor_rdma (use the Python wrapper, not this module)";

  // Exception types are created once per interpreter, as pybind11 recommends.
  PYBIND11_CONSTINIT static py::gil_safe_call_once_and_store<py::object> transport_error;
  PYBIND11_CONSTINIT static py::gil_safe_call_once_and_store<py::object> peer_setup_error;
  transport_error.call_once_and_store_result(
      [&]() { return py::exception<TransportError>(m, "TransportError", PyExc_RuntimeError); });
  peer_setup_error.call_once_and_store_result(
      [&]() { return py::exception<PeerSetupError>(m, "PeerSetupError", transport_error.get_stored()); });
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const PeerSetupError& e) {
      py::set_error(peer_setup_error.get_stored(), py::make_tuple(std::string(e.what()), e.peer));
    } catch (const ArgumentError& e) {
      py::set_error(PyExc_ValueError, e.what());
    } catch (const TransportError& e) {
      py::set_error(transport_error.get_stored(), e.what());
    }
  });

  py::class_<EngineConfig>(m, "EngineConfig")
      .def(py::init<>())
      .def_readwrite("job_id", &EngineConfig::job_id)
      .def_readwrite("rank", &EngineConfig::rank)
      .def_readwrite("world_size", &EngineConfig::world_size)
      .def_readwrite("host_key", &EngineConfig::host_key)
      .def_readwrite("bind_host", &EngineConfig::bind_host)
      .def_readwrite("bind_port", &EngineConfig::bind_port)
      .def_readwrite("send_threads", &EngineConfig::send_threads)
      .def_readwrite("recv_threads", &EngineConfig::recv_threads)
      .def_readwrite("workload_bytes", &EngineConfig::workload_bytes)
      .def_readwrite("eager_bytes", &EngineConfig::eager_bytes)
      .def_readwrite("shm_ctrl_slots", &EngineConfig::shm_ctrl_slots)
      .def_readwrite("shm_bulk_slots", &EngineConfig::shm_bulk_slots)
      .def_readwrite("spin_us", &EngineConfig::spin_us)
      .def_readwrite("allow_shm", &EngineConfig::allow_shm)
      .def_readwrite("allow_tcp", &EngineConfig::allow_tcp)
      .def_readwrite("allow_verbs", &EngineConfig::allow_verbs)
      .def_readwrite("verbs_device", &EngineConfig::verbs_device)
      .def_readwrite("dtype_names", &EngineConfig::dtype_names);

  auto released = py::call_guard<py::gil_scoped_release>();
  py::class_<Engine>(m, "Engine")
      .def(py::init<EngineConfig>(), py::arg("config"), released)
      .def_property_readonly("listen_port", &Engine::listen_port)
      .def_property_readonly("verbs_ready", &Engine::verbs_ready)
      .def("connect", &Engine::connect, py::arg("addresses"), py::arg("timeout_s"), released)
      .def("isend", &Engine::isend, py::arg("data"), py::arg("nbytes"), py::arg("dtype"), py::arg("shape"),
           py::arg("dst"), py::arg("tag"), py::arg("timeout_s"), released)
      .def("irecv", &Engine::irecv, py::arg("data"), py::arg("nbytes"), py::arg("dtype"), py::arg("shape"),
           py::arg("src"), py::arg("tag"), py::arg("timeout_s"), released)
      .def("state", &Engine::state, py::arg("id"), released)
      .def("wait", &Engine::wait, py::arg("id"), py::arg("timeout_s"), released)
      .def("wait_take", [](Engine& e, uint64_t id, double timeout_s) {
        Finished f;
        {
          py::gil_scoped_release nogil;
          f = e.wait(id, timeout_s) ? e.release(id) : Finished{id, 0, 0, ""};
        }
        return finished_tuple(f);
      }, py::arg("id"), py::arg("timeout_s"))
      .def("release", [](Engine& e, uint64_t id) {
        Finished f;
        {
          py::gil_scoped_release nogil;
          f = e.release(id);
        }
        return finished_tuple(f);
      })
      .def("poll", [](Engine& e) {
        std::vector<Finished> v;
        {
          py::gil_scoped_release nogil;
          v = e.poll();
        }
        return finished_list(v);
      })
      .def("wait_any", [](Engine& e, double timeout_s) {
        std::vector<Finished> v;
        {
          py::gil_scoped_release nogil;
          v = e.wait_any(timeout_s);
        }
        return finished_list(v);
      }, py::arg("timeout_s"))
      .def("in_flight", &Engine::in_flight, released)
      .def("describe", py::overload_cast<uint64_t>(&Engine::describe), py::arg("id"), released)
      .def("transport_of", &Engine::transport_of, py::arg("peer"))
      .def("close", &Engine::close, py::arg("grace_s") = 2.0, released);

  m.def("verbs_compiled", &verbs_compiled);
  m.def("verbs_device_ports", [] {
    std::string error;
    auto ports = verbs_device_ports(&error);
    return py::make_tuple(ports, error);
  });
  m.def("shm_segment_name", &shm_segment_name, py::arg("job_id"), py::arg("rank"),
        "Name the segment of (job_id, rank) has for the instant between its creation and unlink.");
  m.def("header_bytes", [] { return sizeof(CtrlHeader); });

  // Pure logic of the verbs transport, exposed for unit tests on machines without RDMA.
  auto t = m.def_submodule("verbs_logic", "device-independent pieces of the verbs transport (tests)");
  t.def("plan_rdma_writes", &plan_rdma_writes, py::arg("nbytes"), py::arg("max_write"));
  t.def("common_mtu", &common_mtu);
  t.def("conn_info_roundtrip", [](uint32_t qp_num, uint32_t psn, uint16_t lid, uint32_t mtu, py::bytes gid, int peer) {
    VerbsConnInfo info;
    info.qp_num = qp_num;
    info.psn = psn;
    info.lid = lid;
    info.mtu = mtu;
    std::string g = gid;
    std::memcpy(info.gid, g.data(), std::min<size_t>(g.size(), sizeof(info.gid)));
    VerbsConnInfo back = VerbsConnInfo::decode(info.encode(), peer);
    return py::make_tuple(back.qp_num, back.psn, back.lid, back.mtu, back.needs_global_route());
  });
  t.def("conn_info_decode", [](py::bytes raw, int peer) {
    VerbsConnInfo info = VerbsConnInfo::decode(std::string(raw), peer);
    return py::make_tuple(info.qp_num, info.psn, info.lid, info.mtu);
  });
  py::class_<ImmTokenTable>(t, "ImmTokenTable")
      .def(py::init<>())
      .def("add", &ImmTokenTable::add)
      .def("take", &ImmTokenTable::take)
      .def("drop", &ImmTokenTable::drop)
      .def("__len__", &ImmTokenTable::size);
}
