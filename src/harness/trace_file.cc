#include "harness/trace_file.h"

#include <fmt/format.h>

#include <cerrno>
#include <chrono>
#include <cstring>

namespace kvferry::harness {

Result<std::unique_ptr<TraceFile>> TraceFile::Open(const std::string& path) {
  std::FILE* file = std::fopen(path.c_str(), "a");
  if (file == nullptr) {
    return Err(ErrorCode::kUnavailable,
               fmt::format("cannot open trace file {}: {}", path, std::strerror(errno)));
  }
  return std::unique_ptr<TraceFile>(new TraceFile(file));
}

TraceFile::~TraceFile() { std::fclose(file_); }

void TraceFile::Line(const std::string& json_object) {
  std::lock_guard<std::mutex> lock(mu_);
  std::fwrite(json_object.data(), 1, json_object.size(), file_);
  std::fputc('\n', file_);
  std::fflush(file_);
}

std::int64_t TraceFile::NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace kvferry::harness
