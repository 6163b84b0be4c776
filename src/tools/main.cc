// kvferry: the command line. `kvferry --help` lists the subcommands.
#include <CLI/CLI.hpp>

#include "commands.h"

int main(int argc, char** argv) {
  CLI::App app{"kvferry: KV cache transfer between prefill and decode, with leases"};
  app.require_subcommand(1);
  int exit_code = 0;
#ifdef KVFERRY_HAVE_SIM
  kvferry::tools::AddSimCommand(app, exit_code);
#endif
#ifdef KVFERRY_HAVE_BENCH
  kvferry::tools::AddBenchCommand(app, exit_code);
#endif
#ifdef KVFERRY_HAVE_DEMO
  kvferry::tools::AddDemoCommand(app, exit_code);
#endif
#ifdef KVFERRY_HAVE_CLIENTS
  kvferry::tools::AddProxyCommand(app, exit_code);
  kvferry::tools::AddLoadCommand(app, exit_code);
  kvferry::tools::AddProbeCommand(app, exit_code);
#endif
#ifdef KVFERRY_HAVE_SERVE
  kvferry::tools::AddServeCommand(app, exit_code);
#endif
#ifdef KVFERRY_HAVE_BOOTSTRAP
  kvferry::tools::AddBootstrapCommand(app, exit_code);
#endif
  CLI11_PARSE(app, argc, argv);
  return exit_code;
}
