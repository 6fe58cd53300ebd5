#pragma once

// The text the LM learns, with no download: every *.py file under a
// directory (the pinned Python's standard library by default, which the
// build finds), or every regular file (/usr/share/common-licenses),
// concatenated in sorted path order, cut at a size limit, split into the
// first 90% for training and the last 10% held out. The same on every rank
// and every run.

#include <ATen/ATen.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

namespace lm {

struct Corpus {
  at::Tensor train;     // uint8 bytes
  at::Tensor held_out;  // uint8 bytes
  int64_t files = 0;
};

inline Corpus load_corpus(const std::string& root, int64_t max_bytes) {
  namespace fs = std::filesystem;
  if (!fs::is_directory(root))
    throw std::runtime_error("corpus directory '" + root + "' does not exist; pass --corpus DIR");
  const bool python_tree = fs::exists(fs::path(root) / "os.py");
  std::vector<std::string> paths;
  for (auto it = fs::recursive_directory_iterator(root, fs::directory_options::skip_permission_denied);
       it != fs::recursive_directory_iterator(); ++it) {
    const std::string name = it->path().filename().string();
    // Installed packages differ from machine to machine; the library does not.
    if (it->is_directory() && (name == "site-packages" || name == "dist-packages" || name == "__pycache__")) {
      it.disable_recursion_pending();
      continue;
    }
    if (!it->is_regular_file() || it->is_symlink()) continue;
    if (python_tree && it->path().extension() != ".py") continue;
    paths.push_back(it->path().string());
  }
  std::sort(paths.begin(), paths.end());
  std::string text;
  Corpus corpus;
  for (const auto& path : paths) {
    if (static_cast<int64_t>(text.size()) >= max_bytes) break;
    std::ifstream in(path, std::ios::binary);
    text.append(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    ++corpus.files;
  }
  if (static_cast<int64_t>(text.size()) > max_bytes) text.resize(static_cast<size_t>(max_bytes));
  if (text.size() < 100000)
    throw std::runtime_error("corpus under '" + root + "' has only " + std::to_string(text.size()) +
                             " bytes; it needs 100000 or more");
  at::Tensor all = at::empty({static_cast<int64_t>(text.size())}, at::kByte);
  std::copy(text.begin(), text.end(), reinterpret_cast<char*>(all.data_ptr<uint8_t>()));
  const int64_t cut = all.numel() * 9 / 10;
  corpus.train = all.narrow(0, 0, cut);
  corpus.held_out = all.narrow(0, cut, all.numel() - cut);
  return corpus;
}

/// `count` windows of `context` + 1 bytes starting at `starts`, as inputs
/// and next-byte targets, int64.
inline std::pair<at::Tensor, at::Tensor> windows(const at::Tensor& bytes, const at::Tensor& starts, int64_t context) {
  at::Tensor index = starts.unsqueeze(1) + at::arange(context + 1, at::kLong).unsqueeze(0);
  at::Tensor rows = bytes.index({index}).to(at::kLong);
  return {rows.narrow(1, 0, context), rows.narrow(1, 1, context)};
}

}  // namespace lm
