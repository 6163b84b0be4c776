// kvferry_transport_peer: the receiver process of the transport tests and benchmark.
#include "peer_process.h"

int main(int argc, char** argv) {
  return kvferry::transport::internal::RunTransferPeer(argc, argv);
}
