// The UCX engine's own protocol between two engines: UCX active messages, their ids and headers.
//
//   HELLO     sender -> receiver on connect: HelloHeader, data = the sender's worker address.
//             The receiver opens (or reuses) one endpoint back to the sending engine, for acks,
//             and counts a reference on it per connection.
//   HELLO_ACK receiver -> sender: HelloAckHeader (the nonce of that connect, the receiver's uid,
//             which must be the descriptor's). Connect returns only after it.
//   WRITE     sender -> receiver, am path only: WriteHeader + one op's bytes.
//   WRITEV    sender -> receiver, am path only: WriteVHeader + `extents` WriteExtents, then the
//             bytes of those ops of one remote region in that order (small ops packed).
//   ACK       receiver -> sender once every op of a batch has landed or was refused: AckHeader.
//   BYE       sender -> receiver on ClosePeer: ByeHeader, ends that connection (its HELLO's
//             nonce) on the receiver; the sender's last one closes the endpoint back
//             (sender_table.h).
//   QUERY     sender -> receiver when a batch's sends have all completed and its ACK has not come
//             for kAckQueryAfter (then again every kAckQueryAfter): QueryHeader. A receiver that
//             acknowledged that batch lately (AckMemory) sends the same ACK again, on its
//             endpoint back and on the query's reply endpoint (the query is sent with
//             UCP_AM_SEND_FLAG_REPLY: an endpoint back that failed, or lost what it carried,
//             leaves that way open); otherwise it logs what it knows of the batch (landing, or
//             never seen) and answers nothing.
//             So a lost ACK costs seconds, not the sender's write bound, and a batch that never
//             landed is named on the receiver.
//
// Contract: both engines run the same kvferry (no version field): a header whose length is not
// its struct's exactly is ignored by ReadHeader's caller (a HELLO so ignored makes the sender's
// Connect time out; a WRITE so ignored is never acknowledged, and its batch times out). Fields
// are host-endian: both ends are one machine architecture. What a field names (a region, a
// range, a write key) is checked by the receiver against its own state before any byte lands;
// the headers' sizes are pinned below, so a change to one is a deliberate wire change.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace kvferry::transport::ucx_am {

constexpr unsigned kHello = 0x4b10;
constexpr unsigned kHelloAck = 0x4b11;
constexpr unsigned kWrite = 0x4b12;
constexpr unsigned kAck = 0x4b13;
constexpr unsigned kBye = 0x4b14;
constexpr unsigned kWriteV = 0x4b15;
constexpr unsigned kQuery = 0x4b16;

// am path: consecutive small ops of one batch into the same remote region travel as one WRITEV
// message (header lists the extents, data is gathered with an iov datatype), so 16 x 64 KiB cost
// one message instead of 16. Ops above kPackMaxOp keep their own zero-copy WRITE.
constexpr std::size_t kPackMaxOp = 256 * 1024;
constexpr std::size_t kPackMaxBytes = 1024 * 1024;
constexpr std::size_t kPackMaxOps = 64;

struct HelloHeader {
  std::uint64_t sender_uid;
  std::uint64_t nonce;
};
struct HelloAckHeader {
  std::uint64_t nonce;
  std::uint64_t receiver_uid;
};
struct WriteHeader {
  std::uint64_t sender_uid;
  std::uint64_t batch_id;
  std::uint64_t write_key;  // the receiver's credential (Engine::RevokeWriteKeys)
  std::uint64_t remote_offset;
  std::uint64_t length;
  std::uint32_t remote_region;
  std::uint32_t op_count;
};
struct WriteVHeader {  // followed by `extents` x WriteExtent
  std::uint64_t sender_uid;
  std::uint64_t batch_id;
  std::uint64_t write_key;
  std::uint32_t remote_region;
  std::uint32_t op_count;  // ops in the whole batch
  std::uint32_t extents;   // ops carried by this message, data in this order
  std::uint32_t reserved;
};
struct WriteExtent {
  std::uint64_t remote_offset;
  std::uint64_t length;
};
struct AckHeader {
  std::uint64_t batch_id;
  std::uint32_t code;  // ErrorCode
  std::uint32_t reserved;
};
struct ByeHeader {
  std::uint64_t sender_uid;
  std::uint64_t nonce;  // the closing connection's, as its HELLO carried it
};
struct QueryHeader {
  std::uint64_t sender_uid;
  std::uint64_t batch_id;
  std::uint32_t attempt;  // 1 for the batch's first query
  std::uint32_t reserved;
};

static_assert(sizeof(HelloHeader) == 16 && sizeof(HelloAckHeader) == 16);
static_assert(sizeof(WriteHeader) == 48 && sizeof(WriteVHeader) == 40);
static_assert(sizeof(WriteExtent) == 16 && sizeof(AckHeader) == 16 && sizeof(ByeHeader) == 16);
static_assert(sizeof(QueryHeader) == 24);

// Copies a received header of exactly sizeof(T) bytes into `out`; false (and `out` untouched)
// for any other length. The copy, not a cast: UCX does not promise the header's alignment.
template <typename T>
bool ReadHeader(const void* header, std::size_t length, T* out) {
  if (length != sizeof(T)) return false;
  std::memcpy(out, header, sizeof(T));
  return true;
}

}  // namespace kvferry::transport::ucx_am
