// `kvferry bootstrap`: the bootstrap service on its own (by default it runs embedded in P's
// rank 0). Serves until SIGINT/SIGTERM. With --cluster-secret-file it requires signed
// registrations and signs its answers (docs/security.md); without, it says once that it is open.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <memory>
#include <string>

#include "commands.h"
#include "control/bootstrap_server.h"
#include "control/cluster_auth.h"

namespace kvferry::tools {

void AddBootstrapCommand(CLI::App& app, int& exit_code) {
  CLI::App* cmd =
      app.add_subcommand("bootstrap", "Run the bootstrap service standalone (HTTP/JSON)");
  auto host = std::make_shared<std::string>("127.0.0.1");
  auto port = std::make_shared<int>(8998);
  auto secret_file = std::make_shared<std::string>();
  cmd->add_option("--host", *host, "Address to bind");
  cmd->add_option("--port", *port, "Port to bind (0: any free port)");
  cmd->add_option("--cluster-secret-file", *secret_file,
                  "The cluster's shared secret (mode 600, 32..4096 bytes): require signed "
                  "registrations, sign answers. Absent: the service is open");
  cmd->callback([host, port, secret_file, &exit_code] {
    control::BootstrapServerOptions options;
    if (!secret_file->empty()) {
      auto secret = control::LoadClusterSecret(*secret_file);
      if (!secret) {
        std::fprintf(stderr, "kvferry bootstrap: %s\n", secret.error().ToString().c_str());
        exit_code = 1;
        return;
      }
      options.cluster_secret = std::make_shared<const control::ClusterSecret>(std::move(*secret));
      std::fprintf(stderr, "kvferry bootstrap: cluster authentication on (fingerprint %s)\n",
                   options.cluster_secret->fingerprint().c_str());
    } else {
      std::fprintf(stderr,
                   "kvferry bootstrap: warning: cluster authentication is off, the service is "
                   "open: anyone who reaches it can register or replace engines. Pass "
                   "--cluster-secret-file (docs/security.md)\n");
    }
    exit_code = control::RunBootstrapServer(*host, *port, std::move(options));
  });
}

}  // namespace kvferry::tools
