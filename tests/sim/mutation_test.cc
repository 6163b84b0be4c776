// Mutation checks: exploration must catch a broken ledger or a broken expiry pass within a
// bounded number of seeds. An invariant suite that cannot fail proves nothing.
//
// The broken variants live here, in test code, and reach the simulator through its seam
// (Variants). LegacyLedger (src/sim/legacy_ledger.h) is the seed's own buggy baseline, shared
// with scenario C.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <deque>

#include "explore.h"
#include "legacy_ledger.h"

namespace kvferry::sim {
namespace {

// vLLM #58222's reaper: it walks entries in admission order and stops at the first one that has
// not expired, so an expired entry behind a renewed (or still waiting) head is stranded. Here:
// the real expiry pass runs only while the oldest admitted live entry's deadline has passed.
class OrderedReaperHold final : public protocol::CoreHold {
 public:
  using CoreHold::CoreHold;
  Status Admit(const core::TransferId& id, std::uint64_t handle, core::TimePoint now) override {
    const bool had = Contains(id);
    Status s = CoreHold::Admit(id, handle, now);
    if (s.ok() && !had) order_.push_back(id);
    return s;
  }
  core::PullAdmission AdmitPull(const core::TransferId& id, std::uint32_t d_rank,
                                std::uint32_t need_send, std::optional<core::Duration> d_lease,
                                core::TimePoint now) override {
    const bool had = Contains(id);
    core::PullAdmission a = CoreHold::AdmitPull(id, d_rank, need_send, d_lease, now);
    if (!had && Contains(id)) order_.push_back(id);
    return a;
  }
  void Expire(core::TimePoint now) override {
    while (!order_.empty() && !Contains(order_.front())) order_.pop_front();
    if (!order_.empty()) {
      const auto head = DeadlineOf(order_.front());
      if (head && *head > now) return;  // the bug: stop at the first unexpired head
    }
    CoreHold::Expire(now);
  }

 private:
  std::deque<core::TransferId> order_;
};

// A P whose renewals extend a transfer by lease/12 instead of 2/3·lease — less than D's renewal
// interval (lease/6) — so a live decoder's KV expires between two renewals: what a renewal pass
// stuck behind silent engines did to P (hole 5). Its deadlines are only ever earlier than the
// real ones, so only the lease-kept invariant can see it.
class ShortRenewalHold final : public protocol::CoreHold {
 public:
  using CoreHold::CoreHold;
  Result<core::HoldTable::RenewResult> Renew(std::span<const core::Fingerprint> ids,
                                             core::TimePoint now) override {
    const core::Duration lease = config().lease;
    return CoreHold::Renew(ids, now - (config().renewal_extension() - lease / 12));
  }
};

// 20,000 seeds take ~3.5 s if none fails (each mutant here fails far earlier). Releases
// (wire::Release) stop most of the late writes a broken ledger would let into freed blocks, so the
// timeout-trusting ledger now needs ~2,750 seeds to be caught (it needed < 2,000 before releases):
// the budget keeps every mutant well in reach.
constexpr std::uint64_t kSeedBudget = 20000;

ExploreFailure FirstFailure(Variants variants) {
  ExploreOptions options;
  options.first_seed = 1;
  options.runs = kSeedBudget;
  options.stop_at_first_failure = true;
  options.variants = std::move(variants);
  ExploreReport report = Explore(options);
  if (report.failures.empty()) return {0, "", {}};
  return report.failures.front();
}

TEST(Mutation, CompleteOnFirstFailureLedgerIsCaught) {
  Variants v;
  v.make_ledger = [] { return std::make_unique<LegacyLedger>(); };
  const ExploreFailure f = FirstFailure(v);
  ASSERT_NE(f.seed, 0u) << "no violation within " << kSeedBudget << " seeds";
  bool write_after_free = false;
  for (const std::string& s : f.violations) {
    write_after_free |= s.find("after D") != std::string::npos;
  }
  EXPECT_TRUE(write_after_free) << f.violations.front();
  std::printf("legacy ledger caught at seed %llu: %s\n", static_cast<unsigned long long>(f.seed),
              f.violations.front().c_str());
}

TEST(Mutation, OrderedReaperIsCaught) {
  Variants v;
  v.make_hold = [](const core::HoldConfig& c) { return std::make_unique<OrderedReaperHold>(c); };
  const ExploreFailure f = FirstFailure(v);
  ASSERT_NE(f.seed, 0u) << "no violation within " << kSeedBudget << " seeds";
  bool stranded = false;
  for (const std::string& s : f.violations) {
    // Seen from outside (the simulator's own deadlines) or from the timer: a pass that leaves
    // an entry due would wake P's thread again at once.
    stranded |= s.find("past its deadline") != std::string::npos ||
                s.find("still due after its pass") != std::string::npos;
  }
  EXPECT_TRUE(stranded) << f.description << "\n"
                        << fmt::format("{}", fmt::join(f.violations, "\n"));
  std::printf("ordered reaper caught at seed %llu: %s\n", static_cast<unsigned long long>(f.seed),
              f.violations.front().c_str());
}

// A ledger that takes a local timeout for proof that the peer stopped writing (no quarantine):
// D reuses the blocks while the slow peer's WRITE is still coming.
class TimeoutTrustingLedger final : public protocol::CoreLedger {
 public:
  core::SettleOutcome Settle(const core::RequestId& request, core::PeerId peer, core::Settle how,
                             Status reason) override {
    if (how == core::Settle::kTimeout) how = core::Settle::kErr;  // the bug
    return CoreLedger::Settle(request, peer, how, std::move(reason));
  }
};

bool AnyWriteAfterFree(const ExploreFailure& f) {
  for (const std::string& s : f.violations) {
    if (s.find("after D") != std::string::npos) return true;
  }
  return false;
}

TEST(Mutation, LedgerThatTrustsTimeoutsIsCaught) {
  Variants v;
  v.make_ledger = [] { return std::make_unique<TimeoutTrustingLedger>(); };
  const ExploreFailure f = FirstFailure(v);
  ASSERT_NE(f.seed, 0u) << "no violation within " << kSeedBudget << " seeds";
  EXPECT_TRUE(AnyWriteAfterFree(f)) << f.violations.front();
  std::printf("timeout-trusting ledger caught at seed %llu: %s\n",
              static_cast<unsigned long long>(f.seed), f.violations.front().c_str());
}

// Releasing quarantined blocks on a fence the data plane did not carry out (as D used to on a
// new registration alone) is caught as a write after free.
TEST(Mutation, FenceBelievedWithoutStoppingWritesIsCaught) {
  Variants v;
  v.lying_fence = true;
  const ExploreFailure f = FirstFailure(v);
  ASSERT_NE(f.seed, 0u) << "no violation within " << kSeedBudget << " seeds";
  EXPECT_TRUE(AnyWriteAfterFree(f)) << f.violations.front();
  std::printf("lying fence caught at seed %llu: %s\n", static_cast<unsigned long long>(f.seed),
              f.violations.front().c_str());
}

TEST(Mutation, HoldWhoseRenewalsFallShortIsCaught) {
  Variants v;
  v.make_hold = [](const core::HoldConfig& c) { return std::make_unique<ShortRenewalHold>(c); };
  const ExploreFailure f = FirstFailure(v);
  ASSERT_NE(f.seed, 0u) << "no violation within " << kSeedBudget << " seeds";
  bool expired = false;
  for (const std::string& s : f.violations) {
    expired |= s.find("while a live D renews it") != std::string::npos;
  }
  EXPECT_TRUE(expired) << f.violations.front();
  std::printf("short-renewal hold caught at seed %llu: %s\n",
              static_cast<unsigned long long>(f.seed), f.violations.front().c_str());
}

TEST(Mutation, TheRealCoreIsWhatTheSimulatorDrivesByDefault) {
  // The seam's defaults are the core classes: exploration without variants tests src/core.
  Variants v;
  EXPECT_NE(dynamic_cast<protocol::CoreHold*>(v.NewHold(core::HoldConfig{}).get()), nullptr);
  EXPECT_NE(dynamic_cast<protocol::CoreLedger*>(v.NewLedger().get()), nullptr);
}

}  // namespace
}  // namespace kvferry::sim
