// Replays files through a fuzz target's LLVMFuzzerTestOneInput without libFuzzer, so the normal
// (g++) build and ctest check every committed seed and crash reproducer.
//
// Usage: wire_replay_<target> <file-or-dir>...   A directory must hold at least one file, so a
// missing corpus fails instead of passing vacuously.
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size);

namespace {

bool RunFile(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    std::fprintf(stderr, "cannot read %s\n", path.c_str());
    return false;
  }
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  // Copy into an exact-size heap buffer so ASan builds catch reads past the end.
  std::vector<std::uint8_t> exact(bytes.begin(), bytes.end());
  std::fprintf(stderr, "replay %s (%zu bytes)\n", path.c_str(), exact.size());
  LLVMFuzzerTestOneInput(exact.data(), exact.size());
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s <file-or-dir>...\n", argv[0]);
    return 2;
  }
  std::size_t files = 0;
  for (int i = 1; i < argc; ++i) {
    const std::filesystem::path arg(argv[i]);
    std::error_code ec;
    if (std::filesystem::is_directory(arg, ec)) {
      std::size_t in_dir = 0;
      for (const auto& entry : std::filesystem::directory_iterator(arg)) {
        if (!entry.is_regular_file()) continue;
        if (!RunFile(entry.path())) return 1;
        ++in_dir;
      }
      if (in_dir == 0) {
        std::fprintf(stderr, "no files in %s\n", arg.c_str());
        return 1;
      }
      files += in_dir;
    } else {
      if (!RunFile(arg)) return 1;
      ++files;
    }
  }
  std::fprintf(stderr, "replayed %zu inputs: ok\n", files);
  return 0;
}
