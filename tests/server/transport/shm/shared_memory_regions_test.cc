// SharedMemoryRegions: a region that a step in flight holds stays mapped after it is unregistered,
// or after its client's connection closes, until the step lets it go; its name is free at once.
#include "server/transport/shm/shared_memory_regions.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "server/transport/shm/shared_mapping.h"
#include "tests/testing/status_matchers.h"

namespace muond::transport {
namespace {

using ::muond::testing::StatusIs;

// A sealed memfd of `bytes`, checked as the daemon checks what a client passes.
SealedMemfd SealedRegion(size_t bytes) {
  const int fd = ::memfd_create("regions-test", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  EXPECT_GE(fd, 0);
  EXPECT_EQ(::ftruncate(fd, static_cast<off_t>(bytes)), 0);
  EXPECT_EQ(::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK), 0);
  absl::StatusOr<SealedMemfd> memfd = SealedMemfd::Check(fd, bytes);
  EXPECT_TRUE(memfd.ok()) << memfd.status();
  return *std::move(memfd);
}

// Registers a region of `bytes` as `name` for `caller` on a new connection; returns the connection.
uint64_t RegisterRegion(SharedMemoryRegions& regions, const std::string& caller, const std::string& name,
                        size_t bytes) {
  const uint64_t connection = regions.OpenConnection();
  absl::StatusOr<std::string> ticket = regions.AddPending(connection, SealedRegion(bytes));
  EXPECT_TRUE(ticket.ok()) << ticket.status();
  EXPECT_TRUE(regions.Register(caller, name, *ticket).ok());
  return connection;
}

TEST(SharedMemoryRegionsTest, UnregisteringARegionAStepHoldsUnmapsItOnlyAfterTheStep) {
  SharedMemoryRegions regions;
  RegisterRegion(regions, "alice", "grads", 4096);
  // A step resolves the region (as StepShared does before reading it) ...
  absl::StatusOr<std::shared_ptr<SharedMapping>> held = regions.Find("alice", "grads", "gradients[0].region");
  ASSERT_TRUE(held.ok());
  std::weak_ptr<SharedMapping> watch = *held;
  absl::StatusOr<std::vector<RegionStatus>> status = regions.Status("alice", "grads");
  ASSERT_TRUE(status.ok());
  EXPECT_EQ((*status)[0].steps_in_flight, 1);

  // ... and the client unregisters it meanwhile: the name is gone at once, the memory is not.
  ASSERT_TRUE(regions.Unregister("alice", "grads").ok());
  EXPECT_THAT(regions.Find("alice", "grads", "gradients[0].region"), StatusIs(absl::StatusCode::kNotFound, "grads"));
  EXPECT_THAT(regions.Status("alice", "grads"), StatusIs(absl::StatusCode::kNotFound, "grads"));
  std::memset((*held)->data(), 7, 4096);  // the step still reads and writes its mapping
  EXPECT_EQ((*held)->data()[4095], 7);
  EXPECT_FALSE(watch.expired());

  // The name may be registered again while the old region is still held.
  RegisterRegion(regions, "alice", "grads", 8192);
  absl::StatusOr<std::shared_ptr<SharedMapping>> fresh = regions.Find("alice", "grads", "gradients[0].region");
  ASSERT_TRUE(fresh.ok());
  EXPECT_EQ((*fresh)->size(), 8192u);
  EXPECT_NE(fresh->get(), held->get());

  held->reset();  // the step is done: now it is unmapped
  EXPECT_TRUE(watch.expired());
}

TEST(SharedMemoryRegionsTest, AClientThatGoesAwayMidStepLeavesItsRegionToTheStep) {
  SharedMemoryRegions regions;
  const uint64_t connection = RegisterRegion(regions, "bob", "params", 4096);
  absl::StatusOr<std::shared_ptr<SharedMapping>> held = regions.Find("bob", "params", "parameters[0].region");
  ASSERT_TRUE(held.ok());
  std::weak_ptr<SharedMapping> watch = *held;
  regions.CloseConnection(connection);  // the client's process exited
  EXPECT_THAT(regions.Find("bob", "params", "parameters[0].region"), StatusIs(absl::StatusCode::kNotFound, "params"));
  std::memset((*held)->data(), 1, 4096);
  EXPECT_FALSE(watch.expired());
  held->reset();
  EXPECT_TRUE(watch.expired());
}

TEST(SharedMemoryRegionsTest, UnclaimedMemfdsAreBoundedDaemonWideAndExpire) {
  SharedMemoryLimits limits;
  limits.max_pending = 3;
  limits.max_pending_per_connection = 2;
  limits.pending_timeout = absl::Seconds(30);
  SharedMemoryRegions regions(limits);
  const absl::Time start = absl::FromUnixSeconds(1000);
  // Two connections fill the daemon's three places; a third connection is refused, not just a fourth
  // memfd of one connection.
  const uint64_t first = regions.OpenConnection(), second = regions.OpenConnection();
  ASSERT_OK(regions.AddPending(first, SealedRegion(64), start).status());
  ASSERT_OK(regions.AddPending(first, SealedRegion(64), start).status());
  absl::StatusOr<std::string> late = regions.AddPending(second, SealedRegion(64), start + absl::Seconds(10));
  ASSERT_OK(late.status());
  EXPECT_THAT(regions.AddPending(regions.OpenConnection(), SealedRegion(64), start),
              StatusIs(absl::StatusCode::kResourceExhausted, "--shm-max-pending-fds"));
  EXPECT_EQ(regions.PendingCount(), 3);
  EXPECT_EQ(regions.NextExpiry(), start + absl::Seconds(30));

  // The first two expire; the late one is still claimable, and there is room again.
  EXPECT_EQ(regions.ExpirePending(start + absl::Seconds(30)), 2);
  EXPECT_EQ(regions.PendingCount(), 1);
  EXPECT_EQ(regions.NextExpiry(), start + absl::Seconds(40));
  ASSERT_OK(regions.AddPending(regions.OpenConnection(), SealedRegion(64), start).status());
  EXPECT_OK(regions.Register("alice", "late", *late).status());
  EXPECT_EQ(regions.ExpirePending(absl::InfiniteFuture()), 1);
  EXPECT_EQ(regions.NextExpiry(), absl::InfiniteFuture());
}

TEST(SharedMemoryRegionsTest, AMemfdIsMappedOnlyWhenAnAuthenticatedCallClaimsIt) {
  // 1 TiB, sparse: checking and holding it costs a descriptor, never address space.
  const uint64_t tib = uint64_t{1} << 40;
  SharedMemoryLimits limits;
  limits.max_pending_per_connection = 100;
  SharedMemoryRegions regions(limits);
  const uint64_t connection = regions.OpenConnection();
  std::vector<std::string> tickets;
  for (int i = 0; i < 100; ++i) {  // 100 TiB of the 128 a process can map, were they mapped
    const int fd = ::memfd_create("huge", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    ASSERT_EQ(::ftruncate(fd, static_cast<off_t>(tib)), 0);
    ASSERT_EQ(::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
    absl::StatusOr<SealedMemfd> memfd = SealedMemfd::Check(fd, tib);
    ASSERT_OK(memfd.status());
    absl::StatusOr<std::string> ticket = regions.AddPending(connection, *std::move(memfd));
    ASSERT_OK(ticket.status());
    tickets.push_back(*ticket);
  }
  // The process's address space is untouched: 64 TiB still fit in one reservation.
  void* probe = ::mmap(nullptr, 64 * tib, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  ASSERT_NE(probe, MAP_FAILED);
  ::munmap(probe, 64 * tib);
  ASSERT_OK(regions.Register("alice", "huge", tickets[0]).status());
  absl::StatusOr<std::shared_ptr<SharedMapping>> mapped = regions.Find("alice", "huge", "region");
  ASSERT_OK(mapped.status());
  EXPECT_EQ((*mapped)->size(), tib);
  regions.CloseConnection(connection);
}

}  // namespace
}  // namespace muond::transport
