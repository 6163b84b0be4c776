// kvferry_bench_transfer: standalone entry point of `kvferry bench transfer`.
#include "bench_transfer.h"

int main(int argc, char** argv) {
  kvferry::transport::BenchOptions options;
  if (!kvferry::transport::ParseBenchFlags(argc, argv, &options)) return 2;
  return kvferry::transport::RunTransferBench(options);
}
