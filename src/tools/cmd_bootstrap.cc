// `kvferry bootstrap`: the bootstrap service on its own (by default it runs embedded in P's
// rank 0). Serves until SIGINT/SIGTERM.
#include <CLI/CLI.hpp>
#include <memory>
#include <string>

#include "commands.h"
#include "control/bootstrap_server.h"

namespace kvferry::tools {

void AddBootstrapCommand(CLI::App& app, int& exit_code) {
  CLI::App* cmd =
      app.add_subcommand("bootstrap", "Run the bootstrap service standalone (HTTP/JSON)");
  auto host = std::make_shared<std::string>("127.0.0.1");
  auto port = std::make_shared<int>(8998);
  cmd->add_option("--host", *host, "Address to bind");
  cmd->add_option("--port", *port, "Port to bind (0: any free port)");
  cmd->callback(
      [host, port, &exit_code] { exit_code = control::RunBootstrapServer(*host, *port); });
}

}  // namespace kvferry::tools
