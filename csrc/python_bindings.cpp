// pybind11 bindings: actoff._C exposes the POSIX I/O engine (IoEngine, Future; errors raise
// OSError), CRC32C, and the plan-replaying allocator core over host memory (HostReplayAllocator).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdlib>
#include <optional>

#include "crc32c.h"
#include "io_engine.h"
#include "replay_allocator.h"

namespace py = pybind11;

namespace {

std::vector<std::tuple<std::size_t, std::int64_t, std::int64_t>> log_tuples(
    const std::vector<actoff::ReplayAllocator::Event>& log) {
  std::vector<std::tuple<std::size_t, std::int64_t, std::int64_t>> out;
  out.reserve(log.size());
  for (const auto& event : log) out.emplace_back(event.size, event.start, event.end);
  return out;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "actoff compiled core: the POSIX asynchronous I/O engine, CRC32C and the replay allocator core";

  // I/O failures surface as Python OSError(errno, message): callers catch OSError, and
  // .errno says what failed (EIO for a short read, 0 for a closed engine).
  py::register_exception_translator([](std::exception_ptr pointer) {
    try {
      if (pointer) std::rethrow_exception(pointer);
    } catch (const actoff::IoError& error) {
      py::tuple args = py::make_tuple(error.code(), error.what());
      PyErr_SetObject(PyExc_OSError, args.ptr());
    }
  });

  py::class_<actoff::Future>(m, "Future")
      .def("done", &actoff::Future::done, "True once the request finished (never blocks).")
      .def("elapsed", &actoff::Future::elapsed, "Seconds a worker spent on the request.")
      .def(
          "checksum",
          [](const actoff::Future& future) -> std::optional<std::uint32_t> {
            const actoff::Seal seal = future.seal();
            if (!seal.on) return std::nullopt;
            return seal.checksum;
          },
          "The seal a sealed write computed of what it wrote (None until done, or unsealed).")
      .def("wait", &actoff::Future::wait, py::call_guard<py::gil_scoped_release>(),
           py::arg("timeout") = -1.0,
           "Block until done (or raise OSError(ETIMEDOUT) after timeout seconds if >= 0); "
           "raise OSError on failure; return the bytes moved.");

  // A request's seal from Python: pwrite(..., sequence=n) seals what it writes; pread(...,
  // sequence=n, checksum=c) fails with EBADMSG unless what it reads has that seal.
  auto seal_of = [](std::optional<std::uint64_t> sequence, std::uint32_t checksum) {
    actoff::Seal seal;
    seal.on = sequence.has_value();
    seal.sequence = sequence.value_or(0);
    seal.checksum = checksum;
    return seal;
  };

  py::class_<actoff::IoEngine>(m, "IoEngine")
      .def(py::init<int, const std::string&, std::size_t, bool, std::size_t>(), py::arg("fd"),
           py::arg("label"), py::arg("num_threads") = 4, py::arg("allow_direct") = true,
           py::arg("alignment") = 4096)
      .def(
          "pwrite",
          [seal_of](actoff::IoEngine& engine, std::uintptr_t address, std::size_t nbytes,
                    std::uint64_t offset, std::optional<std::uint64_t> sequence) {
            return engine.pwrite(reinterpret_cast<const void*>(address), nbytes, offset,
                                 seal_of(sequence, 0));
          },
          py::arg("address"), py::arg("nbytes"), py::arg("offset"), py::arg("sequence") = py::none())
      .def(
          "pread",
          [seal_of](actoff::IoEngine& engine, std::uintptr_t address, std::size_t nbytes,
                    std::uint64_t offset, std::optional<std::uint64_t> sequence,
                    std::uint32_t checksum) {
            return engine.pread(reinterpret_cast<void*>(address), nbytes, offset,
                                seal_of(sequence, checksum));
          },
          py::arg("address"), py::arg("nbytes"), py::arg("offset"), py::arg("sequence") = py::none(),
          py::arg("checksum") = 0)
      .def("reserve", &actoff::IoEngine::reserve, py::call_guard<py::gil_scoped_release>())
      .def("file_size", &actoff::IoEngine::file_size)
      .def("pending", &actoff::IoEngine::pending)
      .def("close", &actoff::IoEngine::close, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("direct_enabled", &actoff::IoEngine::direct_enabled)
      .def_property_readonly("alignment", &actoff::IoEngine::alignment)
      .def_property_readonly("num_threads", &actoff::IoEngine::num_threads)
      .def_property_readonly("path", &actoff::IoEngine::path);

  m.def(
      "crc32c",
      [](py::buffer data, std::uint32_t crc, const std::string& method) {
        Py_buffer view;
        if (PyObject_GetBuffer(data.ptr(), &view, PyBUF_C_CONTIGUOUS) != 0)
          throw py::error_already_set();  // BufferError: not contiguous
        std::uint32_t result;
        try {
          py::gil_scoped_release release;
          const auto nbytes = static_cast<std::size_t>(view.len);
          result = method.empty() ? actoff::crc32c(crc, view.buf, nbytes)
                                  : actoff::crc32c_by(method, crc, view.buf, nbytes);
        } catch (...) {
          PyBuffer_Release(&view);
          throw;  // std::invalid_argument becomes ValueError
        }
        PyBuffer_Release(&view);
        return result;
      },
      py::arg("data"), py::arg("crc") = 0, py::arg("method") = "",
      "CRC32C of a contiguous buffer, continuing `crc`: the fastest method this CPU has, or the "
      "one named (see crc32c_methods).");
  m.def("crc32c_methods", &actoff::crc32c_methods,
        "The CRC32C methods this CPU runs, fastest first: avx512, sse4.2, portable.");
  m.def("seal_start", &actoff::seal_start, py::arg("sequence"), py::arg("nbytes"),
        "The crc a record's seal starts from: crc32c of its sequence number and length.");

  // The allocator core over host memory (aligned malloc as the fallback): what the tests
  // drive. Addresses, streams and fences travel as integers; fences and the arena-released
  // callback may be Python callables (tests simulate streams with them).
  using Replay = actoff::ReplayAllocator;
  py::class_<Replay>(m, "HostReplayAllocator")
      .def(py::init([] {
        return new Replay(
            [](std::size_t size, Replay::Stream) {
              void* pointer = std::aligned_alloc(512, (size + 511) / 512 * 512 + 512);
              if (pointer == nullptr) throw std::bad_alloc();
              return pointer;
            },
            [](void* pointer, std::size_t, Replay::Stream) { std::free(pointer); });
      }))
      .def("begin_record", &Replay::begin_record)
      .def("end_record", [](Replay& self) { return log_tuples(self.end_record()); })
      .def("begin_step", &Replay::begin_step)
      .def("end_step", [](Replay& self) { return log_tuples(self.end_step()); })
      .def(
          "set_plan",
          [](Replay& self, const std::vector<std::size_t>& sizes, const std::vector<std::size_t>& offsets,
             std::uintptr_t arena, std::size_t arena_bytes) {
            self.set_plan(sizes, offsets, reinterpret_cast<void*>(arena), arena_bytes);
          },
          py::arg("sizes"), py::arg("offsets"), py::arg("arena"), py::arg("arena_bytes"))
      .def("clear_plan", &Replay::clear_plan)
      .def(
          "allocate",
          [](Replay& self, std::size_t size, std::uintptr_t stream) {
            return reinterpret_cast<std::uintptr_t>(self.allocate(size, stream));
          },
          py::arg("size"), py::arg("stream") = 0)
      .def("deallocate",
           [](Replay& self, std::uintptr_t address) { self.deallocate(reinterpret_cast<void*>(address)); })
      .def(
          "set_fences",
          [](Replay& self, py::function record, py::function passed, py::function wait, py::function release) {
            Replay::Fences fences;
            fences.record = [record](Replay::Stream stream) {
              return reinterpret_cast<void*>(record(stream).cast<std::uintptr_t>());
            };
            fences.passed = [passed](void* fence) {
              return passed(reinterpret_cast<std::uintptr_t>(fence)).cast<bool>();
            };
            fences.wait = [wait](Replay::Stream stream, void* fence) {
              wait(stream, reinterpret_cast<std::uintptr_t>(fence));
            };
            fences.release = [release](void* fence) { release(reinterpret_cast<std::uintptr_t>(fence)); };
            self.set_fences(std::move(fences));
          },
          py::arg("record"), py::arg("passed"), py::arg("wait"), py::arg("release"))
      .def("set_arena_released",
           [](Replay& self, py::function callback) {
             self.set_arena_released(
                 [callback](void* arena) { callback(reinterpret_cast<std::uintptr_t>(arena)); });
           })
      .def("reset_peak", &Replay::reset_peak)
      .def_property_readonly_static("UNPLANNED", [](py::object) { return Replay::kUnplanned; })
      .def("stats", [](const Replay& self) {
        const Replay::Stats stats = self.stats();
        py::dict out;
        out["served"] = stats.served;
        out["diverged"] = stats.diverged;
        out["occupied"] = stats.occupied;
        out["unplanned"] = stats.unplanned;
        out["outside"] = stats.outside;
        out["fallback"] = stats.fallback;
        out["failed"] = stats.failed;
        out["waits"] = stats.waits;
        out["plans"] = stats.plans;
        out["live"] = stats.live;
        out["live_bytes"] = stats.live_bytes;
        out["peak_bytes"] = stats.peak_bytes;
        out["fallback_bytes"] = stats.fallback_bytes;
        out["arena_bytes"] = stats.arena_bytes;
        out["peak_reserved_bytes"] = stats.peak_reserved_bytes;
        return out;
      });
}
