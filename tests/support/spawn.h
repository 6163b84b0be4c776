// Starting a child process for tests: argv[0] is the binary, stdout and stderr go to `log`
// (truncated). Returns the pid, or -1 if it could not be started.
#pragma once

#include <fcntl.h>
#include <spawn.h>

#include <string>
#include <vector>

extern char** environ;

namespace kvferry::testing {

inline pid_t SpawnWithLog(std::vector<std::string> argv, const std::string& log) {
  std::vector<char*> cargv;
  for (std::string& a : argv) cargv.push_back(a.data());
  cargv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&actions, 1, 2);
  pid_t pid = -1;
  if (posix_spawn(&pid, cargv[0], &actions, nullptr, cargv.data(), environ) != 0) pid = -1;
  posix_spawn_file_actions_destroy(&actions);
  return pid;
}

}  // namespace kvferry::testing
