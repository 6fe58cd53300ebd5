// ProcessGroup's collectives against Python's: run_reference_scenario() makes
// the calls tests/python/collectives_reference.py makes, with the same
// inputs, and writes each result in the same text form, so a test compares
// ddp's lines (over Gloo or MPI) with torch.distributed's (over gloo) line
// for line. The inputs are small integers or floats with few bits: every
// sum is exact in any order.
#pragma once

#include <support/launch.h>
#include <support/subprocess.h>
#include <support/torch_errors.h>

#include <ddp/process_group.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <string>
#include <vector>

namespace ddp::testing {

/// "f32[3] 1 2.5 -3": dtype, shape, then the values, as the script writes them.
inline std::string tensor_text(const at::Tensor& tensor) {
  at::Tensor t = tensor.detach().cpu().contiguous();
  std::string code = t.scalar_type() == at::kFloat ? "f32" : t.scalar_type() == at::kDouble ? "f64" : "i64";
  std::string shape;
  for (int64_t d = 0; d < t.dim(); ++d) shape += (d ? "x" : "") + std::to_string(t.size(d));
  std::string text = code + "[" + shape + "]";
  at::Tensor flat = t.reshape({-1});
  for (int64_t i = 0; i < flat.numel(); ++i) {
    if (t.is_floating_point()) {
      char buffer[64];
      std::snprintf(buffer, sizeof(buffer), "%.17g", flat[i].item<double>());
      text += std::string(" ") + buffer;
    } else {
      text += " " + std::to_string(flat[i].item<int64_t>());
    }
  }
  return text;
}

/// A value's text as the script's canon() writes it: dicts by sorted key.
inline std::string value_text(const c10::IValue& v) {
  if (v.isNone()) return "none";
  if (v.isBool()) return v.toBool() ? "b:true" : "b:false";
  if (v.isInt()) return "i:" + std::to_string(v.toInt());
  if (v.isDouble()) {
    char buffer[64];
    std::snprintf(buffer, sizeof(buffer), "%.17g", v.toDouble());
    return std::string("f:") + buffer;
  }
  if (v.isString()) return "s:" + v.toStringRef();
  if (v.isTensor()) return "t:" + tensor_text(v.toTensor());
  if (v.isList() || v.isTuple()) {
    const bool list = v.isList();
    std::vector<c10::IValue> items;
    if (list) {
      for (const auto& item : v.toListRef()) items.push_back(item);
    } else {
      items = v.toTupleRef().elements().vec();
    }
    std::string text = list ? "[" : "(";
    for (size_t i = 0; i < items.size(); ++i) text += (i ? "," : "") + value_text(items[i]);
    return text + (list ? "]" : ")");
  }
  if (v.isGenericDict()) {
    std::vector<std::pair<std::string, std::string>> entries;
    for (const auto& entry : v.toGenericDict()) {
      const c10::IValue& key = entry.key();
      entries.emplace_back(key.isString() ? key.toStringRef() : std::to_string(key.toInt()), value_text(entry.value()));
    }
    std::sort(entries.begin(), entries.end());
    std::string text = "{";
    for (size_t i = 0; i < entries.size(); ++i) text += (i ? "," : "") + entries[i].first + "=" + entries[i].second;
    return text + "}";
  }
  return "unprintable";
}

/// all_gather_object's value of rank `r`: a string, an int, a small dict in turn.
inline c10::IValue object_of_rank(int r) {
  if (r % 3 == 0) return std::string("text from rank ") + std::to_string(r);
  if (r % 3 == 1) return int64_t{1000 + r};
  c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
  dict.insert("rank", int64_t{r});
  dict.insert("scale", 0.5 * r);
  dict.insert("tag", std::string("x"));
  return dict;
}

/// "1,2" from "... ranks 1, 2 did not reach it ..." (ddp's monitored_barrier error).
inline std::string missing_named(const std::string& error) {
  std::smatch m;
  if (!std::regex_search(error, m, std::regex("ranks? ([0-9, ]+) did not reach it"))) return "unparsed: " + error;
  std::string digits = m[1];
  digits.erase(std::remove(digits.begin(), digits.end(), ' '), digits.end());
  return digits;
}

/// The script's calls on `world` (every rank of it), in the same order; writes
/// <dir>/cpp_<W>_rank<R>.txt. Each monitored_barrier that some ranks skip runs
/// on a group of its own, as in the script.
inline void run_reference_scenario(ProcessGroup& world, const std::string& dir) {
  const int w = world.size(), r = world.rank();
  std::vector<std::string> lines;
  auto emit = [&](const std::string& name, const std::string& text) {
    lines.push_back("rank=" + std::to_string(r) + " " + name + ": " + text);
  };

  at::Tensor t = at::tensor({r + 1.0f, 10.0f * (r + 1), 0.5f * (r + 1)});
  world.reduce(t, w - 1, c10d::ReduceOp::SUM);
  if (r == w - 1) emit("reduce_sum", tensor_text(t));
  t = at::tensor({int64_t{r}, int64_t{100 - r}, int64_t{(7 * r) % 5}});
  world.reduce(t, 1, c10d::ReduceOp::MAX);
  if (r == 1) emit("reduce_max", tensor_text(t));

  std::vector<float> parts;
  std::vector<int64_t> int_parts;
  for (int k = 0; k < 2 * w; ++k) {
    parts.push_back((r + 1) * (k + 1) + 0.25f * k);
    int_parts.push_back((7 * r + 3 * k) % 11);
  }
  at::Tensor input = at::tensor(parts);
  at::Tensor part = at::empty({2});
  world.reduce_scatter(part, input);
  emit("reduce_scatter_sum", tensor_text(part));
  input = at::tensor(int_parts);
  part = at::empty({2}, at::kLong);
  world.reduce_scatter(part, input, c10d::ReduceOp::MAX);
  emit("reduce_scatter_max", tensor_text(part));

  t = at::tensor({int64_t{r}, int64_t{r + 1}, int64_t{r * r}, int64_t{-r}}).view({2, 2});
  std::vector<at::Tensor> gathered = world.gather(t, 1);
  EXPECT_EQ(gathered.size(), r == 1 ? static_cast<size_t>(w) : 0u);
  for (size_t i = 0; i < gathered.size(); ++i) emit("gather[" + std::to_string(i) + "]", tensor_text(gathered[i]));

  at::Tensor out = at::empty({3});
  std::vector<at::Tensor> sources;
  if (r == w - 1) {
    for (int i = 0; i < w; ++i) sources.push_back(at::tensor({100.0f * i + 0.25f, 100.0f * i + 1, -1.0f * i}));
  }
  world.scatter(out, sources, w - 1);
  emit("scatter", tensor_text(out));

  std::vector<int64_t> in_splits, out_splits;
  std::vector<float> rows;
  for (int j = 0; j < w; ++j) {
    in_splits.push_back(r + j + 1);
    out_splits.push_back(j + r + 1);
    for (int k = 0; k < r + j + 1; ++k) {
      const float v = 1000.0f * r + 100.0f * j + k;
      rows.push_back(v);
      rows.push_back(-v);
    }
  }
  input = at::tensor(rows).view({-1, 2});
  int64_t received = 0;
  for (int64_t s : out_splits) received += s;
  out = at::empty({received, 2});
  world.all_to_all(out, input, out_splits, in_splits);
  emit("all_to_all_uneven", tensor_text(out));
  input = at::arange(2 * w, at::kLong) + 10 * r;
  out = at::empty({2 * w}, at::kLong);
  world.all_to_all(out, input);
  emit("all_to_all_even", tensor_text(out));

  at::Tensor send = at::tensor({int64_t{r}, int64_t{r * r}, int64_t{-r}});
  at::Tensor recv = at::empty({3}, at::kLong);
  auto works = world.batch_isend_irecv(
      {P2POp(P2POp::kIsend, send, (r + 1) % w, 3), P2POp(P2POp::kIrecv, recv, (r + w - 1) % w, 3)});
  EXPECT_EQ(works.size(), 2u);
  for (auto& work : works) world.wait(work, "batch_isend_irecv");
  emit("batch_isend_irecv_ring", tensor_text(recv));

  c10::IValue value;
  if (r == w - 1) {
    c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
    dict.insert("name", std::string("adam"));
    dict.insert("step", int64_t{7});
    dict.insert("lr", 0.25);
    dict.insert("betas", c10::List<double>({0.5, 0.75}));
    dict.insert("weights", at::tensor({1.5f, -2.0f}));
    value = dict;
  }
  world.broadcast_object(value, w - 1);
  emit("broadcast_object_dict", value_text(value));
  value = r == 1 ? c10::IValue("hello from rank " + std::to_string(r)) : c10::IValue();
  world.broadcast_object(value, 1);
  emit("broadcast_object_string", value_text(value));
  std::vector<c10::IValue> objects = world.all_gather_object(object_of_rank(r));
  std::string all = "[";
  for (size_t i = 0; i < objects.size(); ++i) all += (i ? "," : "") + value_text(objects[i]);
  emit("all_gather_object", all + "]");

  world.monitored_barrier(std::chrono::seconds(30));
  emit("monitored_barrier_all", "ok");
  const std::chrono::seconds timeout(2);
  std::vector<int> everyone(w);
  for (int i = 0; i < w; ++i) everyone[i] = i;
  auto group = world.new_group(everyone);
  if (r != w - 1) {
    const std::string error = error_of([&] { group->monitored_barrier(timeout); });
    if (r == 0) emit("monitored_barrier_last_missing", error.empty() ? "passed" : missing_named(error));
    // The ranks that came hear from rank 0 whom it missed.
    if (r != 0) EXPECT_EQ(missing_named(error), std::to_string(w - 1)) << error;
  }
  world.barrier();
  for (bool wait_all : {true, false}) {
    group = world.new_group(everyone);
    if (r == 0) {
      const std::string error = error_of([&] { group->monitored_barrier(timeout, wait_all); });
      emit("monitored_barrier_alone_wait_all=" + std::to_string(int{wait_all}),
           error.empty() ? "passed" : missing_named(error));
    }
    world.barrier();
  }

  // Each collective above has its trace record, under its own name.
  std::set<std::string> ops;
  for (const auto& record : world.trace().recent(1000)) ops.insert(record.op);
  for (const char* op : {"reduce", "reduce_scatter", "gather", "scatter", "all_to_all", "send", "recv",
                         "broadcast_object", "all_gather_object", "monitored_barrier"}) {
    EXPECT_TRUE(ops.count(op)) << "no trace record of " << op;
  }

  std::ofstream file(dir + "/cpp_" + std::to_string(w) + "_rank" + std::to_string(r) + ".txt");
  for (const auto& line : lines) file << line << "\n";
}

/// Every line of <dir>/<prefix>_<world>_rank*.txt, sorted.
inline std::vector<std::string> result_lines(const std::string& dir, const std::string& prefix, int world) {
  std::vector<std::string> lines;
  for (int r = 0; r < world; ++r) {
    std::ifstream file(dir + "/" + prefix + "_" + std::to_string(world) + "_rank" + std::to_string(r) + ".txt");
    EXPECT_TRUE(file.good()) << "no results of " << prefix << " rank " << r << " in " << dir;
    for (std::string line; std::getline(file, line);) {
      if (!line.empty()) lines.push_back(line);
    }
  }
  std::sort(lines.begin(), lines.end());
  return lines;
}

/// Runs the script at `world` ranks under torchrun into `dir`, then expects
/// its lines and ddp's to be the same.
inline void expect_same_as_python(const std::string& dir, int world) {
  auto python = run_process({DDP_PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                             std::to_string(world), std::string(DDP_SOURCE_DIR) + "/tests/python/collectives_reference.py",
                             dir},
                            one_rank({}, std::chrono::seconds(170)));
  ASSERT_EQ(python.exit_code, 0) << python.describe();
  const std::vector<std::string> theirs = result_lines(dir, "python", world);
  const std::vector<std::string> ours = result_lines(dir, "cpp", world);
  ASSERT_GT(theirs.size(), 10u);
  std::string differences;
  std::vector<std::string> only;
  std::set_difference(theirs.begin(), theirs.end(), ours.begin(), ours.end(), std::back_inserter(only));
  for (const auto& line : only) differences += "  python only: " + line + "\n";
  only.clear();
  std::set_difference(ours.begin(), ours.end(), theirs.begin(), theirs.end(), std::back_inserter(only));
  for (const auto& line : only) differences += "  ddp only:    " + line + "\n";
  EXPECT_EQ(ours, theirs) << "at " << world << " ranks:\n" << differences;
  std::printf("[ compared ] %zu result lines at %d ranks, ddp against torch.distributed (gloo)\n", ours.size(), world);
}

}  // namespace ddp::testing
