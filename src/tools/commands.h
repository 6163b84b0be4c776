// Subcommands of the `kvferry` CLI. Each lives in its own file (cmd_<name>.cc) so CLI11, the
// heaviest header we use, is compiled only in src/tools.
#pragma once

namespace CLI {
class App;
}

namespace kvferry::tools {

// Each Add*Command registers its subcommand and the callback that runs it. The callback stores
// the process exit code in `exit_code`.
void AddSimCommand(CLI::App& app, int& exit_code);
void AddBenchCommand(CLI::App& app, int& exit_code);
// `kvferry bench http`, a subcommand of `bench` (bench_http.cc).
void AddHttpBenchCommand(CLI::App& bench, int& exit_code);
void AddDemoCommand(CLI::App& app, int& exit_code);
void AddProxyCommand(CLI::App& app, int& exit_code);
void AddLoadCommand(CLI::App& app, int& exit_code);
void AddProbeCommand(CLI::App& app, int& exit_code);
void AddServeCommand(CLI::App& app, int& exit_code);
void AddBootstrapCommand(CLI::App& app, int& exit_code);

}  // namespace kvferry::tools
