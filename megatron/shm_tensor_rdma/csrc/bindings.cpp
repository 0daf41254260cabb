// pybind11 bindings of the engine. Arguments are checked in the engine and surface here as
// ValueError (bad argument), _C.TransportError, or _C.PeerSetupError(message, peer_rank); the
// typed wrapper in megatron/shm_tensor_rdma turns those into its public exceptions. Every
// call that can wait releases the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <deque>

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

// The fast path for a plain tensor: its pointer, size, dtype and shape read through the C API in
// one call, instead of five attribute reads and a list built by the Python wrapper (which cost
// more than the transfer itself for small messages). Anything it does not recognize goes back to
// the wrapper's checked path, which owns every error message.
struct TorchRefs {
  PyObject* tensor_type = nullptr;  // torch.Tensor: exact type only, subclasses take the checked path
  PyObject* codes = nullptr;        // {torch.dtype: wire code}
  std::vector<uint64_t> itemsize;   // by wire code
  PyObject* s_is_cpu = nullptr;
  PyObject* s_is_contiguous = nullptr;
  PyObject* s_dtype = nullptr;
  PyObject* s_shape = nullptr;
  PyObject* s_data_ptr = nullptr;
};
TorchRefs torch_refs;  // set once by set_torch_refs; the references are kept for the process's life

// The arguments of a fast-path post, read out of Python objects.
struct PlainPost {
  uintptr_t data = 0;
  uint64_t nbytes = 0;
  uint32_t dtype = 0;
  std::vector<int64_t> shape;
  int peer = 0;
  int64_t tag = 0;

  uint64_t post(Engine& e, bool is_send, double timeout_s) const {
    return e.post(is_send, data, nbytes, dtype, shape, peer, tag, timeout_s);
  }
};

// New reference to t.<name> or t.<name>(), or nullptr (with any Python error cleared).
PyObject* get_attr(PyObject* t, PyObject* name, bool call) {
  PyObject* v = call ? PyObject_CallMethodNoArgs(t, name) : PyObject_GetAttr(t, name);
  if (!v) PyErr_Clear();
  return v;
}

bool is_true_attr(PyObject* t, PyObject* name, bool call) {
  PyObject* v = get_attr(t, name, call);
  bool ok = v == Py_True;
  Py_XDECREF(v);
  return ok;
}

// True for a torch.Tensor (exact type) that is contiguous, on the CPU, has storage, a dtype in
// the table and at most kMaxDims dimensions; fills `out`. Five reads of the tensor, as few as
// that takes: a sparse tensor is not contiguous (or cannot say), an MKL-DNN one has no data
// pointer, and nbytes is numel times the item size.
bool plain_cpu_tensor(PyObject* t, PlainPost& out) {
  const TorchRefs& r = torch_refs;
  if (!r.tensor_type || Py_TYPE(t) != reinterpret_cast<PyTypeObject*>(r.tensor_type)) return false;
  if (!is_true_attr(t, r.s_is_cpu, false) || !is_true_attr(t, r.s_is_contiguous, true)) return false;
  PyObject* dtype = get_attr(t, r.s_dtype, false);
  if (!dtype) return false;
  PyObject* code = PyDict_GetItemWithError(r.codes, dtype);  // borrowed
  Py_DECREF(dtype);
  if (!code) {
    PyErr_Clear();
    return false;
  }
  out.dtype = static_cast<uint32_t>(PyLong_AsUnsignedLong(code));
  if (out.dtype >= r.itemsize.size() || r.itemsize[out.dtype] == 0) return false;
  PyObject* shape = get_attr(t, r.s_shape, false);
  if (!shape) return false;
  bool ok = PyTuple_Check(shape) && PyTuple_GET_SIZE(shape) <= static_cast<Py_ssize_t>(kMaxDims);
  uint64_t numel = 1;
  if (ok) {
    const Py_ssize_t n = PyTuple_GET_SIZE(shape);
    out.shape.resize(static_cast<size_t>(n));
    for (Py_ssize_t i = 0; i < n && ok; ++i) {
      const int64_t d = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, i));
      out.shape[static_cast<size_t>(i)] = d;
      numel *= static_cast<uint64_t>(d);
      ok = d >= 0 && !PyErr_Occurred();
    }
    if (!ok) PyErr_Clear();
  }
  Py_DECREF(shape);
  if (!ok) return false;
  out.nbytes = numel * r.itemsize[out.dtype];
  PyObject* ptr = get_attr(t, r.s_data_ptr, true);
  if (!ptr) return false;
  out.data = static_cast<uintptr_t>(PyLong_AsUnsignedLongLong(ptr));
  Py_DECREF(ptr);
  if (PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  return true;
}

// An exact Python int within int64 (bool excluded); false sends the wrapper to its checked path.
bool plain_int(PyObject* v, int64_t* out) {
  if (!PyLong_CheckExact(v)) return false;
  int overflow = 0;
  *out = PyLong_AsLongLongAndOverflow(v, &overflow);
  if (overflow || (*out == -1 && PyErr_Occurred())) {
    PyErr_Clear();
    return false;
  }
  return true;
}

// Reads the arguments of a fast-path post; false when the wrapper must check them itself.
bool plain_post(py::handle tensor, py::handle peer, py::handle tag, PlainPost& out) {
  int64_t p = 0;
  if (!plain_int(peer.ptr(), &p) || p < INT32_MIN || p > INT32_MAX || !plain_int(tag.ptr(), &out.tag)) return false;
  out.peer = static_cast<int>(p);
  return plain_cpu_tensor(tensor.ptr(), out);
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
      .def_readwrite("single_copy", &EngineConfig::single_copy)
      .def_readwrite("allow_shm", &EngineConfig::allow_shm)
      .def_readwrite("allow_tcp", &EngineConfig::allow_tcp)
      .def_readwrite("allow_verbs", &EngineConfig::allow_verbs)
      .def_readwrite("verbs_device", &EngineConfig::verbs_device)
      .def_readwrite("dtype_names", &EngineConfig::dtype_names)
      .def_readwrite("device_key", &EngineConfig::device_key);

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
      .def("isend_device", &Engine::isend_device, py::arg("descriptor"), py::arg("nbytes"), py::arg("dtype"),
           py::arg("shape"), py::arg("dst"), py::arg("tag"), py::arg("timeout_s"), released)
      .def("device_done", &Engine::device_done, py::arg("peer"), py::arg("send_id"), py::arg("ok"), py::arg("reason"),
           released)
      .def("peer_device_key", &Engine::peer_device_key, py::arg("peer"))
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
      // Handle.wait's fast path: waits without a limit and takes the outcome; None when the
      // transfer succeeded, else what wait_take returns (a failure, a receive whose bytes the
      // caller copies out of a peer's GPU memory, or -1 for an id another thread's poll() took first).
      .def("wait_done", [](Engine& e, uint64_t id) -> py::object {
        Finished f;
        {
          py::gil_scoped_release nogil;
          f = e.wait_release(id);
        }
        if (f.state == static_cast<int>(ReqState::Done) && f.error_kind == 0) return py::none();
        return finished_tuple(f);
      }, py::arg("id"))
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
      // Posts and waits in one call (the blocking send/recv): no Handle, one GIL round trip.
      // Returns when the transfer finished or failed (its own timeout ends it).
      .def("transfer", [](Engine& e, bool is_send, uintptr_t data, uint64_t nbytes, uint32_t dtype,
                          const std::vector<int64_t>& shape, int peer, int64_t tag, double timeout_s) {
        Finished f;
        {
          py::gil_scoped_release nogil;
          f = e.wait_release(e.post(is_send, data, nbytes, dtype, shape, peer, tag, timeout_s));
        }
        return finished_tuple(f);
      }, py::arg("is_send"), py::arg("data"), py::arg("nbytes"), py::arg("dtype"), py::arg("shape"), py::arg("peer"),
         py::arg("tag"), py::arg("timeout_s"))
      // The library's own latency, without Python: `iters` round trips of `nbytes` with `peer`
      // (the initiator sends first); returns seconds per one-way message. Both ranks call it.
      .def("ping_pong", [](Engine& e, int peer, uint64_t nbytes, int iters, bool initiator, int64_t tag) {
        py::gil_scoped_release nogil;
        std::vector<uint8_t> out(nbytes ? nbytes : 1, 1), back(nbytes ? nbytes : 1, 0);
        const std::vector<int64_t> shape{static_cast<int64_t>(nbytes)};
        auto once = [&](bool send) {
          auto data = reinterpret_cast<uintptr_t>(send ? out.data() : back.data());
          Finished f = e.wait_release(e.post(send, data, nbytes, 0, shape, peer, tag, 60));
          if (f.state != static_cast<int>(ReqState::Done)) throw TransportError("ping_pong: " + f.message);
        };
        const auto started = Clock::now();
        for (int i = 0; i < iters; ++i) {
          once(initiator);
          once(!initiator);
        }
        return std::chrono::duration<double>(Clock::now() - started).count() / (2.0 * iters);
      }, py::arg("peer"), py::arg("nbytes"), py::arg("iters"), py::arg("initiator"), py::arg("tag"))
      // The library's own streaming rate, without Python: the sender keeps `window` messages
      // of `nbytes` in flight to `peer` (the receiver as many receives), `iters` in all, then
      // the receiver acknowledges; returns seconds on the sender from the first send to the ack.
      .def("stream", [](Engine& e, int peer, uint64_t nbytes, int iters, int window, bool sender, int64_t tag) {
        py::gil_scoped_release nogil;
        if (window < 1) throw ArgumentError("stream: window must be >= 1");
        std::vector<std::vector<uint8_t>> buffers(window, std::vector<uint8_t>(nbytes ? nbytes : 1, sender ? 1 : 0));
        uint8_t ack = 0;
        const std::vector<int64_t> shape{static_cast<int64_t>(nbytes)}, one{1};
        auto check = [&](uint64_t id) {
          Finished f = e.wait_release(id);
          if (f.state != static_cast<int>(ReqState::Done)) throw TransportError("stream: " + f.message);
        };
        std::deque<uint64_t> in_flight;
        const auto started = Clock::now();
        int posted = 0;
        auto post = [&] {
          auto data = reinterpret_cast<uintptr_t>(buffers[posted % window].data());
          in_flight.push_back(e.post(sender, data, nbytes, 0, shape, peer, tag, 60));
          ++posted;
        };
        while (posted < iters && posted < window) post();
        while (!in_flight.empty()) {
          check(in_flight.front());
          in_flight.pop_front();
          if (posted < iters) post();
        }
        const auto ack_ptr = reinterpret_cast<uintptr_t>(&ack);
        check(e.post(!sender, ack_ptr, 1, 0, one, peer, tag + 1, 60));
        return std::chrono::duration<double>(Clock::now() - started).count();
      }, py::arg("peer"), py::arg("nbytes"), py::arg("iters"), py::arg("window"), py::arg("sender"), py::arg("tag"))
      // Fast paths of the wrapper's send/recv and isend/irecv for a plain CPU tensor (see
      // plain_cpu_tensor). post_plain returns the request id, plain_transfer None when done or
      // (error_kind, message) when failed or left to the caller to copy (DeviceCopy); both
      // return False for arguments they do not take.
      .def("post_plain", [](Engine& e, bool is_send, py::handle tensor, py::handle peer, py::handle tag,
                            double timeout_s) -> py::object {
        PlainPost args;
        if (!plain_post(tensor, peer, tag, args)) return py::bool_(false);
        uint64_t id;
        {
          py::gil_scoped_release nogil;
          id = args.post(e, is_send, timeout_s);
        }
        return py::int_(id);
      })
      .def("plain_transfer", [](Engine& e, bool is_send, py::handle tensor, py::handle peer, py::handle tag,
                                double timeout_s) -> py::object {
        PlainPost args;
        if (!plain_post(tensor, peer, tag, args)) return py::bool_(false);
        Finished f;
        {
          py::gil_scoped_release nogil;
          f = e.wait_release(args.post(e, is_send, timeout_s));
        }
        if (f.state == static_cast<int>(ReqState::Done) && f.error_kind == 0) return py::none();
        return py::make_tuple(f.error_kind, f.message);
      })
      .def("in_flight", &Engine::in_flight, released)
      .def("describe", py::overload_cast<uint64_t>(&Engine::describe), py::arg("id"), released)
      .def("transport_of", &Engine::transport_of, py::arg("peer"))
      .def("copy_path", &Engine::copy_path, py::arg("peer"))
      .def("stats", &Engine::stats, released)
      .def("close", &Engine::close, py::arg("grace_s") = 2.0, released);

  m.def("set_torch_refs", [](py::handle tensor_type, py::dict codes, std::vector<uint64_t> itemsize) {
    auto name = [](const char* s) { return PyUnicode_InternFromString(s); };
    TorchRefs r;
    r.tensor_type = tensor_type.inc_ref().ptr();
    r.codes = codes.inc_ref().ptr();
    r.itemsize = std::move(itemsize);
    r.s_is_cpu = name("is_cpu");
    r.s_is_contiguous = name("is_contiguous");
    r.s_dtype = name("dtype");
    r.s_shape = name("shape");
    r.s_data_ptr = name("data_ptr");
    torch_refs = std::move(r);
  }, py::arg("tensor_type"), py::arg("codes"), py::arg("itemsize"),
     "Gives the fast path torch.Tensor, the dtype code table and each code's item size (once, on import).");
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
