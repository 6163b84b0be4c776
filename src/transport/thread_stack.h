// SampleStack: the user-space call stack of another thread of this process, taken while it runs.
//
// Why: the real-vLLM tier caught a P's UCX progress thread spinning 5-130 s inside one
// ucp_worker_progress call, "running, not in a system call", with UCX's own async thread idle
// (docs/vllm.md, known issue). /proc says that a thread spins, never where; gdb attached to a
// vLLM worker at such a moment killed it once and found the spin over the other times. A
// sample taken from inside the process by a signal costs the spinning thread microseconds and
// names the loop: the function, its library and the offset within it, which objdump or
// addr2line turn into a line of UCX even for its static functions.
//
// Contract: SampleStack(tid, wait) sends one real-time signal to thread `tid` of this process;
// its handler (async-signal-safe: backtrace(), primed at installation so that it never loads
// libgcc then, and atomics) records up to 32 return addresses, and the caller symbolizes them
// with dladdr after the handler is done. Frames come innermost first, from the interrupted
// code on (the handler and the signal trampoline are left out). One sample at a time per
// process: concurrent callers wait for each other. An error, and nothing sent, where no
// real-time signal is free (every candidate already has a handler: this never takes a
// signal from its owner), where `tid` is not a thread of this process, or where the handler
// did not run within `wait` (the thread blocks the signal); a handler that runs after the
// caller gave up records nothing. A system call the signal interrupts restarts (SA_RESTART),
// except those that never do (poll, epoll_wait: their callers see EINTR, which every such loop
// here and in UCX retries), so sample a thread that runs, not one that waits. Linux only;
// elsewhere every call is an error.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <string>
#include <vector>

#include "kvferry/status.h"

namespace kvferry::transport {

// "libucp.so.0+0x2a1b0 ucp_worker_progress+0x40": the object (its file name) and the offset
// in it, then the nearest exported symbol and the offset from it where dladdr finds one.
[[nodiscard]] Result<std::vector<std::string>> SampleStack(pid_t tid,
                                                           std::chrono::milliseconds wait);

}  // namespace kvferry::transport
