// The error file a worker leaves for its launcher (src/launch/error_file.cpp): whether an error is a
// consequence of another rank's failure is decided by its type for ddp's errors, and by its text
// only for exceptions that are not ddp's.

#include <ddp/error.h>
#include <ddp/error_file.h>
#include <ddp/process_group.h>

#include <gtest/gtest.h>

#include "support/subprocess.h"

#include <c10/util/Exception.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include <unistd.h>

namespace {

// Records `error` into a fresh error file and returns the file's text.
std::string recorded(const std::exception& error) {
  const std::string dir = ddp::testing::make_temp_dir("ddp_error_file");
  const std::string path = dir + "/error.json";
  ::setenv("TORCHELASTIC_ERROR_FILE", path.c_str(), 1);
  const bool wrote = ddp::record_error(error);
  ::unsetenv("TORCHELASTIC_ERROR_FILE");
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  std::filesystem::remove_all(dir);
  EXPECT_TRUE(wrote) << error.what();
  return text.str();
}

bool recorded_as_consequence(const std::exception& error) {
  const std::string text = recorded(error);
  const bool yes = text.find("\"consequence\": true") != std::string::npos;
  const bool no = text.find("\"consequence\": false") != std::string::npos;
  EXPECT_NE(yes, no) << text;
  return yes;
}

// Anyone who can write into the attempt directory can plant links where the
// record will be written: at its temporary's old predictable name, and at the
// error file itself. Neither is followed; the victims keep their bytes.
TEST(ErrorFile, LinksPlantedWhereTheRecordIsWrittenAreNeverFollowed) {
  namespace fs = std::filesystem;
  const std::string dir = ddp::testing::make_temp_dir("ddp_error_file_links");
  const std::string victim = dir + "/victim.txt";
  { std::ofstream(victim) << "the user's own words"; }
  const std::string path = dir + "/error.json";
  fs::create_symlink(victim, path + ".tmp." + std::to_string(::getpid()));
  ::setenv("TORCHELASTIC_ERROR_FILE", path.c_str(), 1);
  ddp::record_error(ddp::Error("ddp: bad option"));
  std::ifstream in(victim);
  std::stringstream text;
  text << in.rdbuf();
  EXPECT_EQ(text.str(), "the user's own words");
  EXPECT_TRUE(fs::exists(path)) << "the record itself is still written, under a fresh temporary";

  const std::string other_victim = dir + "/empty_victim.txt";
  { std::ofstream touch(other_victim); }
  fs::remove(path);
  fs::create_symlink(other_victim, path);
  EXPECT_FALSE(ddp::record_error(ddp::Error("ddp: bad option")));
  ::unsetenv("TORCHELASTIC_ERROR_FILE");
  EXPECT_EQ(fs::file_size(other_victim), 0u);
  EXPECT_TRUE(fs::is_symlink(path));
  fs::remove_all(dir);
}

TEST(ErrorFile, APeerFailureIsAConsequenceByItsType) {
  // No sentence the text heuristics know: the type alone says it.
  EXPECT_TRUE(recorded_as_consequence(ddp::PeerFailure("ddp: rank 3 left the job")));
}

TEST(ErrorFile, AnyOtherDdpErrorIsOriginalWhateverItsText) {
  // Reads like a consequence ("timed out"), but ddp threw it as its own error.
  EXPECT_FALSE(recorded_as_consequence(ddp::Error("ddp: loading 'model.pt' timed out on a slow disk")));
  const std::string text = recorded(ddp::Error("ddp: bad option"));
  EXPECT_NE(text.find("\"message\": \"ddp: bad option\""), std::string::npos) << text;
}

TEST(ErrorFile, OtherExceptionsAreJudgedByTheirText) {
  EXPECT_TRUE(recorded_as_consequence(std::runtime_error("Read error [127.0.0.1]:4242: Connection reset by peer")));
  EXPECT_FALSE(recorded_as_consequence(std::runtime_error("shape mismatch in layer 2")));
  try {
    TORCH_CHECK(false, "Socket Timeout");  // a c10::Error that is not ddp's
  } catch (const c10::Error& e) {
    EXPECT_TRUE(recorded_as_consequence(e));
  }
}

// The text is read only for other libraries' words (launch_errors.h): each pattern as Gloo, c10d
// or the OS words it, and none of ddp's own phrases, which its PeerFailure type has replaced.
TEST(ErrorFile, OnlyOtherLibrariesPhrasesReadAsConsequences) {
  for (const char* foreign : {
           "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242",
           "[../third_party/gloo/gloo/transport/tcp/pair.cc:598] Write error [127.0.0.1]:4242: Broken pipe",
           "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1800000ms for recv "
           "operation to complete",
           "wait timeout after 300ms, keys: /default_pg/0//cuda//0",
       }) {
    EXPECT_TRUE(recorded_as_consequence(std::runtime_error(foreign))) << foreign;
  }
  // ddp's own messages, quoted by a program that rethrew them as its own exception.
  for (const char* ddps : {
           "training failed: ddp: all_reduce failed on rank 0 of 2; a peer may have died or stopped calling "
           "collectives.",
           "training failed: ddp: rank 0 waited 5 s for the other 1 rank(s), but not all of them joined",
           "training failed: ddp: the checkpoint failed on rank 1 (rank 0 stops too)",
           "training failed: ddp: rank 1 cannot reach the master at 10.0.0.5:29500 within 5 s",
           "training failed: ddp: rank 1 reached the store but rank 0 did not publish its run id there",
           "training failed: ddp: rank 1 waited 5 s for rank 0 to join, but it did not",
       }) {
    EXPECT_FALSE(recorded_as_consequence(std::runtime_error(ddps))) << ddps;
  }
}

// The throw sites: a rank whose peers never come fails with a PeerFailure, and so does a rank
// that cannot reach its master, so their error files name them consequences.
TEST(ErrorFile, RendezvousWithoutPeersThrowsPeerFailure) {
  ddp::World world;
  world.world_size = 2;
  world.local_world_size = 2;
  world.master_addr = "127.0.0.1";
  world.master_port = ddp::testing::free_port();
  world.source = "torchrun";
  const auto options = ddp::ProcessGroupOptions().backend(ddp::BackendKind::kGloo).timeout(std::chrono::milliseconds(300));

  world.rank = 0;  // hosts the store; rank 1 never joins
  try {
    ddp::ProcessGroup::create(world, options);
    ADD_FAILURE() << "rank 0 formed a group of two alone";
  } catch (const ddp::PeerFailure& e) {
    EXPECT_NE(std::string(e.what()).find("not all of them joined"), std::string::npos) << e.what();
  }

  world.rank = 1;  // nobody listens on the master's port
  try {
    ddp::ProcessGroup::create(world, options);
    ADD_FAILURE() << "rank 1 joined a master that does not exist";
  } catch (const ddp::PeerFailure& e) {
    EXPECT_NE(std::string(e.what()).find("cannot reach the master"), std::string::npos) << e.what();
  }
}

}  // namespace
