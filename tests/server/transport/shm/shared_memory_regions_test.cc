// SharedMemoryRegions: a region that a step in flight holds stays mapped after it is unregistered,
// or after its client's connection closes, until the step lets it go; its name is free at once.
#include "server/transport/shm/shared_memory_regions.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>

#include "gmock/gmock.h"
#include "server/transport/shm/shared_mapping.h"
#include "tests/testing/status_matchers.h"

namespace muond::transport {
namespace {

using ::muond::testing::StatusIs;

// A sealed memfd of `bytes`, mapped as the daemon maps what a client passes.
std::shared_ptr<SharedMapping> SealedRegion(size_t bytes) {
  const int fd = ::memfd_create("regions-test", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  EXPECT_GE(fd, 0);
  EXPECT_EQ(::ftruncate(fd, static_cast<off_t>(bytes)), 0);
  EXPECT_EQ(::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK), 0);
  absl::StatusOr<std::shared_ptr<SharedMapping>> mapping = SharedMapping::Map(fd, bytes);
  EXPECT_TRUE(mapping.ok()) << mapping.status();
  return *mapping;
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

}  // namespace
}  // namespace muond::transport
