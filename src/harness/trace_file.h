// TraceFile: JSON lines appended to one file by many threads (block events on D, WRITE start/end
// on P). Each line is written and flushed whole under a mutex, so traces of several processes
// can be merged by t_ns (steady clock, system-wide on Linux) even after a SIGKILL.
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>

#include "kvferry/status.h"

namespace kvferry::harness {

class TraceFile {
 public:
  // Opens `path` for appending. kUnavailable when it cannot be opened.
  [[nodiscard]] static Result<std::unique_ptr<TraceFile>> Open(const std::string& path);
  ~TraceFile();
  TraceFile(const TraceFile&) = delete;
  TraceFile& operator=(const TraceFile&) = delete;

  // Appends `json_object` and a newline.
  void Line(const std::string& json_object);
  // Steady-clock nanoseconds, the t_ns of every line.
  static std::int64_t NowNs();

 private:
  explicit TraceFile(std::FILE* file) : file_(file) {}
  std::mutex mu_;
  std::FILE* file_;
};

}  // namespace kvferry::harness
