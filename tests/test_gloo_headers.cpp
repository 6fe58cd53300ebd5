// The torch wheel ships no Gloo headers, so ddp compiles c10d's
// ProcessGroupGloo.hpp against Debian's libgloo-dev. That is sound only if
// ddp never compiles Gloo code or Gloo class layouts of its own: every Gloo
// symbol it uses must be one libtorch_cpu defines, and it must not link
// Debian's libgloo. These tests check the built library's symbols.

#include <gtest/gtest.h>
#include <support/subprocess.h>

#include <set>
#include <sstream>

namespace {

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// Symbol names from `nm -D -C` output lines ("  U name" or "addr T name").
std::vector<std::string> symbols(const std::vector<std::string>& args) {
  auto result = ddp::testing::run_process(args);
  EXPECT_EQ(result.exit_code, 0) << result.describe();
  std::vector<std::string> names;
  // 16 hex digits (or blanks), a space, the symbol type, a space, the name.
  for (const auto& line : lines_of(result.out)) {
    if (line.size() > 19) names.push_back(line.substr(19));
  }
  return names;
}

TEST(GlooHeaders, NoGloo_CodeIsCompiledIntoDdp) {
  auto defined = symbols({"nm", "-D", "-C", "--defined-only", DDP_LIBRARY_PATH});
  ASSERT_FALSE(defined.empty());
  for (const auto& name : defined) {
    EXPECT_NE(name.rfind("gloo::", 0), 0u) << "ddp defines a Gloo symbol: " << name;
    EXPECT_EQ(name.find("ProcessGroupGloo::GlooStore"), std::string::npos)
        << "ddp instantiates c10d's Gloo store wrapper: " << name;
  }
}

TEST(GlooHeaders, EveryGlooSymbolWeUseComesFromLibtorch) {
  auto undefined = symbols({"nm", "-D", "-C", "--undefined-only", DDP_LIBRARY_PATH});
  auto torch_defined = symbols({"nm", "-D", "-C", "--defined-only", std::string(DDP_TORCH_LIB_DIR) + "/libtorch_cpu.so"});
  std::set<std::string> provided(torch_defined.begin(), torch_defined.end());
  int gloo_related = 0;
  for (const auto& name : undefined) {
    bool is_gloo = name.rfind("gloo::", 0) == 0 || name.find("ProcessGroupGloo") != std::string::npos;
    if (!is_gloo) continue;
    ++gloo_related;
    EXPECT_TRUE(provided.count(name)) << "ddp needs " << name << ", which libtorch_cpu does not export";
  }
  // The constructor, the options and the device factory at least.
  EXPECT_GE(gloo_related, 3);
}

TEST(GlooHeaders, DebiansLibglooIsNotLinked) {
  auto result = ddp::testing::run_process({"readelf", "-d", DDP_LIBRARY_PATH});
  ASSERT_EQ(result.exit_code, 0) << result.describe();
  EXPECT_EQ(result.out.find("libgloo"), std::string::npos) << result.out;
  EXPECT_NE(result.out.find("libtorch_cpu.so"), std::string::npos) << result.out;
}

}  // namespace
