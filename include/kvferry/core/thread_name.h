// Names the calling thread for `top -H`, `perf sched`, gdb and /proc/<pid>/task/*/comm, so an
// operator can tell which of kvferry's threads spins or waits. Linux keeps 15 bytes of a name:
// longer names are cut there. Failure is ignored (a name is a diagnostic, never a dependency).
#pragma once

#include <pthread.h>

#include <string>
#include <string_view>

namespace kvferry::core {

inline void NameThisThread(std::string_view name) {
  const std::string cut(name.substr(0, 15));
  (void)pthread_setname_np(pthread_self(), cut.c_str());
}

}  // namespace kvferry::core
