// Trains a byte-level transformer language model (byte_lm.h) on text every
// machine has (corpus.h), data-parallel over the ranks of a job, with DDP
// (gradients averaged every step) or over slow links with DiLoCo,
// Streaming DiLoCo or post-local SGD (<ddp/diloco.h>):
//
//   ddprun --standalone --nproc-per-node 2 lm_train --steps 600
//   ddprun --standalone --nproc-per-node 2 lm_train --steps 600 --diloco 50
//   ddprun --standalone --nproc-per-node 2 lm_train --steps 600 --diloco 50 --streaming 4 --overlap 5
//   ddprun --standalone --nproc-per-node 2 lm_train --steps 600 --diloco 50 --post-local-sgd 100
//
// Every rank draws its own batches (a generator seeded by --seed and its
// rank); every --eval-every steps rank 0 evaluates its model on the same
// held-out windows and appends a JSON line to --metrics:
//   {"step": 100, "samples": 6400, "train_loss": 2.41, "eval_loss": 2.47, "wall_s": 12.3, "syncs": 2}
// Under DiLoCo with --eval-every a multiple of H (and no overlap) the model
// evaluated is the freshly synchronised global one.

#include "../common/command_line.h"
#include "byte_lm.h"
#include "corpus.h"

#include <ddp/ddp.h>

#include <torch/nn/functional/loss.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <memory>
#include <optional>

#ifndef DDP_LM_CORPUS
#define DDP_LM_CORPUS "/usr/share/common-licenses"
#endif

namespace {

struct Args {
  int64_t steps = 600;
  int64_t batch_size = 16;
  double lr = 3e-3;
  uint64_t seed = 0;
  int64_t eval_every = 50;
  int64_t eval_batches = 8;
  std::string metrics;
  std::string corpus = DDP_LM_CORPUS;
  int64_t corpus_mb = 4;
  lm::ModelConfig model;
  int64_t diloco = 0;  // H; 0: DDP
  int64_t streaming = 1;
  int64_t overlap = 0;
  double mixing = 0.0;
  std::string outer_dtype = "fp32";
  double outer_lr = 0.7;
  int64_t post_local_sgd = -1;  // K; -1: DiLoCo's outer Nesterov SGD
  int64_t warmup = 0;           // DiLoCo's steps of gradient averaging first
  std::string backend = "auto";
  int64_t threads = 1;
  std::string snapshot_dir;
  int64_t snapshot_every = 0;
  int64_t powersgd = 0;  // DDP's PowerSGD rank; 0: plain all-reduce
  std::string strategy = "ddp";
};

Args parse_args(int argc, char** argv) {
  Args a;
  examples::CommandLine cli("Trains a byte-level transformer LM with DDP or DiLoCo.", argv[0]);
  auto positive = [](const char* name) { return examples::positive_integer(name); };
  cli.add_option("--steps", a.steps, "inner steps each rank takes")->type_name("N")->transform(positive("--steps"));
  cli.add_option("--batch-size", a.batch_size, "windows per step on each rank")
      ->type_name("N")
      ->transform(positive("--batch-size"));
  cli.add_option("--lr", a.lr, "AdamW's learning rate (the inner optimizer's)")->type_name("LR");
  cli.add_option("--seed", a.seed, "model and batch seed")->type_name("N");
  cli.add_option("--eval-every", a.eval_every, "evaluate and log every N steps")
      ->type_name("N")
      ->transform(positive("--eval-every"));
  cli.add_option("--eval-batches", a.eval_batches, "held-out batches per evaluation")
      ->type_name("N")
      ->transform(positive("--eval-batches"));
  cli.add_option("--metrics", a.metrics, "write one JSON line per evaluation to FILE (rank 0)")
      ->type_name("FILE")
      ->default_str("none");
  cli.add_option("--corpus", a.corpus, "text: *.py under DIR if it holds os.py, else every file")->type_name("DIR");
  cli.add_option("--corpus-mb", a.corpus_mb, "use the first N MiB of the corpus")
      ->type_name("N")
      ->transform(positive("--corpus-mb"));
  cli.add_option("--context", a.model.context, "bytes per window")->type_name("N")->transform(positive("--context"));
  cli.add_option("--width", a.model.width, "embedding size")->type_name("N")->transform(positive("--width"));
  cli.add_option("--layers", a.model.layers, "transformer blocks")->type_name("N")->transform(positive("--layers"));
  cli.add_option("--heads", a.model.heads, "attention heads")->type_name("N")->transform(positive("--heads"));
  cli.add_option("--diloco", a.diloco, "sync every H steps with DiLoCo instead of DDP")
      ->type_name("H")
      ->default_str("0: DDP")
      ->transform(examples::non_negative_integer("--diloco"));
  cli.add_option("--streaming", a.streaming, "Streaming DiLoCo: F fragments synced in turn")
      ->type_name("F")
      ->transform(positive("--streaming"));
  cli.add_option("--overlap", a.overlap, "a fragment's sync overlaps TAU inner steps")
      ->type_name("TAU")
      ->transform(examples::non_negative_integer("--overlap"));
  cli.add_option("--mixing", a.mixing, "alpha: local <- alpha*local + (1-alpha)*global")->type_name("A");
  cli.add_option("--outer-dtype", a.outer_dtype, "pseudo-gradients travel as fp32, bf16 or int8")
      ->type_name("T")
      ->check(examples::one_of("--outer-dtype", {"fp32", "bf16", "int8"}));
  cli.add_option("--outer-lr", a.outer_lr, "the outer Nesterov SGD's learning rate")->type_name("LR");
  cli.add_option("--post-local-sgd", a.post_local_sgd,
                 "post-local SGD: K steps of gradient averaging, then model\naveraging every --diloco H steps")
      ->type_name("K")
      ->default_str("off")
      ->transform(examples::non_negative_integer("--post-local-sgd"));
  cli.add_option("--warmup", a.warmup,
                 "DiLoCo: average gradients (as DDP) for the first K steps,\nthen sync every H (the paper starts from "
                 "a trained model)")
      ->type_name("K")
      ->transform(examples::non_negative_integer("--warmup"));
  cli.add_option("--backend", a.backend, "auto, gloo or mpi")
      ->type_name("NAME")
      ->check(examples::one_of("--backend", {"auto", "gloo", "mpi"}));
  cli.add_option("--threads", a.threads, "intra-op threads per rank")->type_name("N")->transform(positive("--threads"));
  cli.add_option("--strategy", a.strategy,
                 "without --diloco: ddp, fsdp (sharded over every rank) or hsdp\n(sharded in a node, replicated across nodes)")
      ->type_name("S")
      ->check(examples::one_of("--strategy", {"ddp", "fsdp", "hsdp"}));
  cli.add_option("--powersgd", a.powersgd, "DDP with PowerSGD of this rank, compressing from step 10")
      ->type_name("R")
      ->default_str("off")
      ->transform(positive("--powersgd"));
  cli.add_option("--snapshot-dir", a.snapshot_dir,
                 "write sharded snapshots into DIR and resume from its newest,\nwritten at any world size")
      ->type_name("DIR");
  cli.add_option("--snapshot-every", a.snapshot_every, "steps between snapshots (with --snapshot-dir)")
      ->type_name("N")
      ->default_str("off")
      ->transform(positive("--snapshot-every"));
  cli.read(argc, argv);
  if (a.strategy != "ddp" && (a.diloco > 0 || a.powersgd > 0))
    throw examples::UsageError("--strategy " + a.strategy + " shards the model instead of DDP; drop --diloco and --powersgd");
  if (a.powersgd > 0 && a.diloco > 0) throw examples::UsageError("--powersgd compresses DDP's gradients; drop --diloco");
  if (a.snapshot_every > 0 && a.snapshot_dir.empty()) throw examples::UsageError("--snapshot-every needs --snapshot-dir");
  if (a.diloco == 0 &&
      (a.streaming != 1 || a.overlap != 0 || a.post_local_sgd >= 0 || a.mixing != 0.0 || a.warmup != 0)) {
    throw examples::UsageError("--streaming, --overlap, --mixing, --warmup and --post-local-sgd need --diloco H");
  }
  if (a.post_local_sgd >= 0 && a.warmup != 0)
    throw examples::UsageError("--post-local-sgd K is its own warm-up; drop --warmup");
  if (a.model.width % a.model.heads != 0) throw examples::UsageError("--width must be a multiple of --heads");
  return a;
}

ddp::OuterGradientDtype outer_dtype(const std::string& name) {
  if (name == "bf16") return ddp::OuterGradientDtype::kBFloat16;
  if (name == "int8") return ddp::OuterGradientDtype::kInt8;
  return ddp::OuterGradientDtype::kFloat32;
}

at::Tensor next_byte_loss(const at::Tensor& logits, const at::Tensor& targets) {
  return torch::nn::functional::cross_entropy(logits.reshape({-1, 256}), targets.reshape({-1}));
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  try {
    args = parse_args(argc, argv);
  } catch (const examples::UsageError& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 2;
  }
  try {
    torch::set_num_threads(static_cast<int>(args.threads));
    auto group = ddp::init_process_group(ddp::ProcessGroupOptions().backend(ddp::parse_backend(args.backend)));
    const int rank = group->rank();
    const lm::Corpus corpus = lm::load_corpus(args.corpus, args.corpus_mb << 20);

    torch::manual_seed(args.seed);
    lm::ByteLM model(args.model);
    int64_t parameter_count = 0;
    for (const auto& p : model->parameters()) parameter_count += p.numel();

    // DDP, FSDP or HSDP, or the plain model with DiLoCo around its optimizer.
    std::unique_ptr<ddp::DistributedDataParallel<lm::ByteLM>> ddp_model;
    std::unique_ptr<ddp::FullyShardedDataParallel<lm::ByteLM>> fsdp_model;
    if (args.strategy == "fsdp") {
      fsdp_model = std::make_unique<ddp::FullyShardedDataParallel<lm::ByteLM>>(model, group);
    } else if (args.strategy == "hsdp") {
      fsdp_model = std::make_unique<ddp::FullyShardedDataParallel<lm::ByteLM>>(
          model, ddp::DeviceMesh::from_launcher(group),
          ddp::FSDPOptions().sharding_strategy(ddp::ShardingStrategy::kHybridShard));
    } else if (args.diloco == 0) {
      ddp::DDPOptions ddp_options;
      if (args.powersgd > 0) {
        ddp_options.comm_hook(
            // PyTorch starts compressing after 1000 plain steps; a short
            // run starts after 10 (past DDP's bucket rebuild).
            ddp::powersgd_hook(ddp::PowerSGDOptions().matrix_approximation_rank(args.powersgd).start_powerSGD_iter(10)));
      }
      ddp_model = std::make_unique<ddp::DistributedDataParallel<lm::ByteLM>>(model, group, ddp_options);
    }
    torch::optim::AdamW inner(fsdp_model ? fsdp_model->parameters() : model->parameters(),
                              torch::optim::AdamWOptions(args.lr).weight_decay(0.01));
    std::unique_ptr<ddp::DiLoCo> diloco;
    if (args.diloco > 0) {
      auto options =
          args.post_local_sgd >= 0
              ? ddp::DiLoCoOptions::post_local_sgd(args.post_local_sgd, args.diloco)
              : ddp::DiLoCoOptions().sync_every(args.diloco).outer_lr(args.outer_lr).warmup_steps(args.warmup);
      options.fragments(args.streaming)
          .overlap_steps(args.overlap)
          .mixing(args.mixing)
          .outer_gradient_dtype(outer_dtype(args.outer_dtype));
      diloco = std::make_unique<ddp::DiLoCo>(*model, inner, group, options);
    }
    if (rank == 0) {
      std::printf(
          "lm_train: %lld parameters, %lld ranks, corpus %s (%lld files, %lld train + %lld held-out bytes), %s\n",
          static_cast<long long>(parameter_count), static_cast<long long>(group->size()), args.corpus.c_str(),
          static_cast<long long>(corpus.files), static_cast<long long>(corpus.train.numel()),
          static_cast<long long>(corpus.held_out.numel()),
          args.diloco > 0 ? (args.post_local_sgd >= 0 ? "post-local SGD" : "DiLoCo")
                          : (args.strategy == "ddp" ? "DDP" : args.strategy == "fsdp" ? "FSDP" : "HSDP"));
    }

    // The same held-out windows at every evaluation, spread over the split.
    const int64_t context = args.model.context;
    const int64_t eval_windows = args.eval_batches * args.batch_size;
    at::Tensor eval_starts =
        at::linspace(0, static_cast<double>(corpus.held_out.numel() - context - 2), eval_windows).to(at::kLong);
    auto evaluate = [&]() {
      torch::NoGradGuard no_grad;
      double total = 0;
      for (int64_t b = 0; b < args.eval_batches; ++b) {
        auto [x, y] =
            lm::windows(corpus.held_out, eval_starts.narrow(0, b * args.batch_size, args.batch_size), context);
        total += next_byte_loss(model->forward(x), y).item<double>();
      }
      return total / static_cast<double>(args.eval_batches);
    };

    // The newest sharded snapshot, whatever world size wrote it: after
    // ddprun --nnodes MIN:MAX lost a node, the replicas that are left go on
    // from it (DiLoCo: replica r from replica r mod N's local state).
    int64_t first_step = 1;
    std::optional<ddp::SnapshotSaver> saver;
    if (!args.snapshot_dir.empty()) {
      saver.emplace(args.snapshot_dir);
      const auto resumed = diloco       ? ddp::load_newest_sharded_snapshot(args.snapshot_dir, *diloco, &inner)
                           : fsdp_model ? ddp::load_newest_sharded_snapshot(args.snapshot_dir, *fsdp_model, &inner)
                                        : ddp::load_newest_sharded_snapshot(args.snapshot_dir, *ddp_model, &inner);
      if (resumed) first_step = resumed->step + 1;
      if (resumed && rank == 0) {
        std::printf("lm_train: resumed from the snapshot of step %lld at %lld ranks\n",
                    static_cast<long long>(resumed->step), static_cast<long long>(group->size()));
      }
    }

    std::FILE* metrics = nullptr;
    if (rank == 0 && !args.metrics.empty()) {
      metrics = std::fopen(args.metrics.c_str(), "w");
      DDP_CHECK(metrics != nullptr, "cannot write the metrics file '", args.metrics, "'");
    }
    auto generator = at::make_generator<at::CPUGeneratorImpl>(args.seed * 1000003 + static_cast<uint64_t>(rank) + 1);
    const auto start = std::chrono::steady_clock::now();
    double train_loss_sum = 0;
    int64_t train_loss_count = 0;
    for (int64_t step = 1; step < first_step; ++step) {  // the batches a resumed run already trained on
      (void)at::randint(0, corpus.train.numel() - context - 1, {args.batch_size}, generator);
    }
    for (int64_t step = first_step; step <= args.steps; ++step) {
      at::Tensor starts = at::randint(0, corpus.train.numel() - context - 1, {args.batch_size}, generator);
      auto [x, y] = lm::windows(corpus.train, starts, context);
      inner.zero_grad();
      at::Tensor loss = next_byte_loss(
          fsdp_model ? fsdp_model->forward(x) : (ddp_model ? (*ddp_model)(x) : model->forward(x)), y);
      loss.backward();
      if (diloco) {
        diloco->step();
      } else {
        inner.step();
      }
      train_loss_sum += loss.item<double>();
      ++train_loss_count;
      if (saver && args.snapshot_every > 0 && step % args.snapshot_every == 0) {
        const ddp::TrainingProgress progress{0, step, 0};
        if (diloco) saver->save(*diloco, &inner, progress);
        else if (fsdp_model) saver->save(*fsdp_model, &inner, progress);
        else saver->save(*ddp_model, &inner, progress);
      }
      if (step % args.eval_every != 0 && step != args.steps) continue;
      if (step == args.steps && diloco) diloco->flush();
      // FSDP's shards are gathered on every rank (collective) for rank 0 to evaluate.
      std::optional<ddp::FullParamsGuard> gathered;
      if (fsdp_model) gathered.emplace(fsdp_model->summon_full_params());
      if (rank == 0) {
        const double eval_loss = evaluate();
        const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        const double train_loss = train_loss_sum / static_cast<double>(train_loss_count);
        const long long samples = static_cast<long long>(step * args.batch_size * group->size());
        // Gradient syncs of training: one a step for DDP; for DiLoCo its
        // warm-up gradient averages and its pseudo-gradient syncs.
        const long long syncs =
            diloco ? static_cast<long long>(diloco->syncs_started() + std::min(step, diloco->options().warmup_steps()))
                   : static_cast<long long>(step);
        std::printf("step %lld  train %.4f  eval %.4f  %.1f s\n", static_cast<long long>(step), train_loss, eval_loss,
                    wall);
        if (metrics) {
          std::fprintf(metrics,
                       "{\"step\": %lld, \"samples\": %lld, \"train_loss\": %.6f, \"eval_loss\": %.6f, "
                       "\"wall_s\": %.3f, \"syncs\": %lld}\n",
                       static_cast<long long>(step), samples, train_loss, eval_loss, wall, syncs);
          std::fflush(metrics);
        }
        std::fflush(stdout);
      }
      train_loss_sum = 0;
      train_loss_count = 0;
    }
    if (metrics) std::fclose(metrics);
    group->shutdown();
    return 0;
  } catch (const std::exception& e) {
    ddp::record_error(e);
    std::cerr << "lm_train: " << e.what() << "\n";
    return 1;
  }
}
