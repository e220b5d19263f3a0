// SharedMemoryRegions: a region that a step in flight holds stays mapped after it is unregistered,
// or after its client's connection closes, until the step lets it go; its name is free at once.
#include "server/transport/shm/shared_memory_regions.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <optional>
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

// A new connection bound to `caller` with a grant, as the socket binds one.
uint64_t BoundConnection(SharedMemoryRegions& regions, const std::string& caller, absl::Time now = absl::Now()) {
  const uint64_t connection = regions.OpenConnection();
  EXPECT_OK(regions.Bind(connection, regions.Grant(caller, now), now));
  return connection;
}

// Registers a region of `bytes` as `name` for `caller` on a new connection; returns the connection.
uint64_t RegisterRegion(SharedMemoryRegions& regions, const std::string& caller, const std::string& name,
                        size_t bytes) {
  const uint64_t connection = BoundConnection(regions, caller);
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
  std::optional<AnswerClaims> claims(std::in_place, std::vector<AnswerGate*>{&(*held)->answers()}, "s", 0);
  absl::StatusOr<std::vector<RegionStatus>> status = regions.Status("alice", "grads");
  ASSERT_TRUE(status.ok());
  EXPECT_EQ((*status)[0].steps_in_flight, 1);
  claims.reset();
  EXPECT_EQ((*held)->answers().calls_in_flight(), 0);

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

TEST(SharedMemoryRegionsTest, UnclaimedMemfdsAreBoundedAndExpire) {
  SharedMemoryLimits limits;
  limits.max_pending = 3;
  limits.max_pending_per_connection = 2;
  limits.pending_timeout = absl::Seconds(30);
  SharedMemoryRegions regions(limits);
  const absl::Time start = absl::FromUnixSeconds(1000);
  const uint64_t first = BoundConnection(regions, "alice", start), second = BoundConnection(regions, "alice", start);
  ASSERT_OK(regions.AddPending(first, SealedRegion(64), start).status());
  ASSERT_OK(regions.AddPending(first, SealedRegion(64), start).status());
  EXPECT_THAT(regions.AddPending(first, SealedRegion(64), start),
              StatusIs(absl::StatusCode::kResourceExhausted, "this connection holds 2"));
  absl::StatusOr<std::string> late = regions.AddPending(second, SealedRegion(64), start + absl::Seconds(10));
  ASSERT_OK(late.status());
  EXPECT_EQ(regions.PendingCount(), 3);
  EXPECT_EQ(regions.NextExpiry(), start + absl::Seconds(30));

  // The first two expire; the late one is still claimable.
  EXPECT_EQ(regions.ExpirePending(start + absl::Seconds(30)), 2);
  EXPECT_EQ(regions.PendingCount(), 1);
  EXPECT_EQ(regions.NextExpiry(), start + absl::Seconds(40));
  EXPECT_OK(regions.Register("alice", "late", *late).status());
  EXPECT_EQ(regions.ExpirePending(absl::InfiniteFuture()), 0);
  EXPECT_EQ(regions.NextExpiry(), absl::InfiniteFuture());
}

TEST(SharedMemoryRegionsTest, AConnectionWithoutAGrantHoldsNoDescriptor) {
  SharedMemoryRegions regions;
  const absl::Time now = absl::FromUnixSeconds(1000);
  const uint64_t connection = regions.OpenConnection();
  EXPECT_THAT(regions.AddPending(connection, SealedRegion(64), now),
              StatusIs(absl::StatusCode::kFailedPrecondition, "presented no grant"));
  EXPECT_EQ(regions.PendingCount(), 0);
  EXPECT_FALSE(regions.IsBound(connection));
  // An unknown grant, an expired one, and one used twice bind nothing.
  EXPECT_THAT(regions.Bind(connection, "0123456789abcdef0123456789abcdef", now),
              StatusIs(absl::StatusCode::kPermissionDenied, "grant"));
  const std::string expired = regions.Grant("alice", now);
  EXPECT_THAT(regions.Bind(connection, expired, now + regions.limits().pending_timeout),
              StatusIs(absl::StatusCode::kPermissionDenied, "expired"));
  const std::string grant = regions.Grant("alice", now);
  ASSERT_OK(regions.Bind(connection, grant, now));
  EXPECT_TRUE(regions.IsBound(connection));
  EXPECT_THAT(regions.Bind(regions.OpenConnection(), grant, now),
              StatusIs(absl::StatusCode::kPermissionDenied, "used"));
  EXPECT_THAT(regions.Bind(connection, regions.Grant("alice", now), now),
              StatusIs(absl::StatusCode::kFailedPrecondition, "presented one already"));
  // What the connection passed is Alice's to claim, nobody else's.
  absl::StatusOr<std::string> ticket = regions.AddPending(connection, SealedRegion(64), now);
  ASSERT_OK(ticket.status());
  EXPECT_THAT(regions.Register("mallory", "stolen", *ticket), StatusIs(absl::StatusCode::kNotFound, "ticket"));
  EXPECT_OK(regions.Register("alice", "mine", *ticket).status());
  // Closed, the connection is unbound again (its id is never reused).
  regions.CloseConnection(connection);
  EXPECT_FALSE(regions.IsBound(connection));
}

TEST(SharedMemoryRegionsTest, OneCallerCannotLockAnotherOut) {
  SharedMemoryLimits limits;
  limits.max_pending = 4;
  limits.max_connections = 8;  // a caller's share: 2 connections
  SharedMemoryRegions regions(limits);
  const absl::Time start = absl::FromUnixSeconds(1000);
  // Mallory fills every place the daemon has for unclaimed memfds, on her share of connections.
  const uint64_t m1 = BoundConnection(regions, "mallory", start), m2 = BoundConnection(regions, "mallory", start);
  const uint64_t m3 = regions.OpenConnection();
  EXPECT_THAT(regions.Bind(m3, regions.Grant("mallory", start), start),
              StatusIs(absl::StatusCode::kResourceExhausted, "--shm-max-connections"));
  std::vector<std::string> mallorys;
  for (int i = 0; i < 4; ++i) {
    absl::StatusOr<std::string> ticket =
        regions.AddPending(i % 2 == 0 ? m1 : m2, SealedRegion(64), start + absl::Seconds(i));
    ASSERT_OK(ticket.status());
    mallorys.push_back(*ticket);
  }
  // Alice still gets a connection and a place: Mallory's oldest memfd makes room.
  const uint64_t alice = BoundConnection(regions, "alice", start);
  int evicted = 0;
  absl::StatusOr<std::string> ticket = regions.AddPending(alice, SealedRegion(64), start + absl::Seconds(5), &evicted);
  ASSERT_OK(ticket.status());
  EXPECT_EQ(evicted, 1);
  EXPECT_EQ(regions.PendingCount(), 4);
  EXPECT_OK(regions.Register("alice", "grads", *ticket).status());
  EXPECT_THAT(regions.Register("mallory", "first", mallorys[0]), StatusIs(absl::StatusCode::kNotFound, "ticket"));
  EXPECT_OK(regions.Register("mallory", "second", mallorys[1]).status());
  // Grants hold no descriptor but are bounded all the same: the oldest of a caller goes.
  const std::string oldest = regions.Grant("mallory", start);
  for (int i = 0; i < SharedMemoryLimits::kMaxGrantsPerCaller; ++i) regions.Grant("mallory", start + absl::Seconds(1));
  regions.CloseConnection(m1);
  EXPECT_THAT(regions.Bind(regions.OpenConnection(), oldest, start + absl::Seconds(2)),
              StatusIs(absl::StatusCode::kPermissionDenied, "grant"));
}

TEST(SharedMemoryRegionsTest, AMemfdIsMappedOnlyWhenAnAuthenticatedCallClaimsIt) {
  // 1 TiB, sparse: checking and holding it costs a descriptor, never address space.
  const uint64_t tib = uint64_t{1} << 40;
  SharedMemoryLimits limits;
  limits.max_pending_per_connection = 100;
  SharedMemoryRegions regions(limits);
  const uint64_t connection = BoundConnection(regions, "alice");
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
