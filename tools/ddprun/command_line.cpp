// The grammar of ddprun's command line: torchrun 2.11's flags and ddprun's own, read by CLI11.
// What each value may be is flag_values.cpp's; the --help text is usage_text.cpp's.
#include "command_line.h"

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <map>

#include "flag_values.h"

namespace ddprun {
namespace {

// kOptionalValue: a flag whose value may be left out (see argparse_words()).
enum class FlagKind { kValue, kSwitch, kOptionalValue };

// How torchrun's argparse actions fill in a flag the command line leaves out.
enum class EnvDefault {
  kNone,  // no environment default: ddprun's own flags, and torchrun's --logs-specs, --numa-binding
  kPet,   // PET_<NAME>, '-' as '_', upper case (torchrun's `env` and `check_env` actions)
};

struct FlagSpec {
  const char* name;  // canonical spelling, without the leading "--"
  FlagKind kind;
  EnvDefault env_default;
  char short_name;  // torchrun's one-letter spelling ("-r"), or 0
};

// Every torchrun 2.11 flag, then ddprun's own; -h/--help is CLI11's. The order is the order
// they are applied in.
constexpr FlagSpec kFlags[] = {
    {"nnodes", FlagKind::kValue, EnvDefault::kPet, 0},
    {"nproc-per-node", FlagKind::kValue, EnvDefault::kPet, 0},
    {"rdzv-backend", FlagKind::kValue, EnvDefault::kPet, 0},
    {"rdzv-endpoint", FlagKind::kValue, EnvDefault::kPet, 0},
    {"rdzv-id", FlagKind::kValue, EnvDefault::kPet, 0},
    {"rdzv-conf", FlagKind::kValue, EnvDefault::kPet, 0},
    {"standalone", FlagKind::kSwitch, EnvDefault::kPet, 0},
    {"max-restarts", FlagKind::kValue, EnvDefault::kPet, 0},
    {"monitor-interval", FlagKind::kValue, EnvDefault::kPet, 0},
    {"start-method", FlagKind::kValue, EnvDefault::kPet, 0},
    {"event-log-handler", FlagKind::kValue, EnvDefault::kPet, 0},
    {"role", FlagKind::kValue, EnvDefault::kPet, 0},
    {"module", FlagKind::kSwitch, EnvDefault::kPet, 'm'},
    {"no-python", FlagKind::kSwitch, EnvDefault::kPet, 0},
    {"run-path", FlagKind::kSwitch, EnvDefault::kPet, 0},
    {"log-dir", FlagKind::kValue, EnvDefault::kPet, 0},
    {"redirects", FlagKind::kValue, EnvDefault::kPet, 'r'},
    {"tee", FlagKind::kOptionalValue, EnvDefault::kPet, 't'},
    {"local-ranks-filter", FlagKind::kValue, EnvDefault::kPet, 0},
    {"duplicate-stdout-filters", FlagKind::kValue, EnvDefault::kPet, 0},
    {"duplicate-stderr-filters", FlagKind::kValue, EnvDefault::kPet, 0},
    {"node-rank", FlagKind::kValue, EnvDefault::kPet, 0},
    {"master-addr", FlagKind::kValue, EnvDefault::kPet, 0},
    {"master-port", FlagKind::kValue, EnvDefault::kPet, 0},
    {"local-addr", FlagKind::kValue, EnvDefault::kPet, 0},
    {"logs-specs", FlagKind::kValue, EnvDefault::kNone, 0},
    {"numa-binding", FlagKind::kValue, EnvDefault::kNone, 0},
    {"signals-to-handle", FlagKind::kValue, EnvDefault::kPet, 0},
    {"virtual-local-rank", FlagKind::kSwitch, EnvDefault::kPet, 0},
    // ddprun's own.
    {"grace-period", FlagKind::kValue, EnvDefault::kNone, 0},
    {"no-prefix", FlagKind::kSwitch, EnvDefault::kNone, 0},
    {"run-id", FlagKind::kValue, EnvDefault::kNone, 0},  // --rdzv-id by another name
    {"rdzv-secret-file", FlagKind::kValue, EnvDefault::kNone, 0},
    {"cpu-bind", FlagKind::kValue, EnvDefault::kNone, 0},
    // Per-step fault tolerance; PET_ defaults like torchrun's own flags.
    {"fault-tolerance", FlagKind::kSwitch, EnvDefault::kPet, 0},
    {"ft-deadline", FlagKind::kValue, EnvDefault::kPet, 0},
    {"ft-replica-size", FlagKind::kValue, EnvDefault::kPet, 0},
    {"ft-store-port", FlagKind::kValue, EnvDefault::kNone, 0},
};

// Where several flags set one value, the name they are applied under.
std::string applied_as(const FlagSpec& flag) {
  return std::string(flag.name) == "run-id" ? "rdzv-id" : flag.name;
}

std::string pet_name(const std::string& canonical_name) {
  std::string name = "PET_";
  for (char c : canonical_name) name += c == '-' ? '_' : static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return name;
}

// A flag's spellings, as torchrun defines them: "--nproc-per-node" and "--nproc_per_node", and
// the one-letter "-r" where there is one.
std::vector<std::string> spellings_of(const FlagSpec& flag) {
  std::vector<std::string> spellings = {std::string("--") + flag.name};
  std::string underscored = spellings.front();
  std::replace(underscored.begin() + 2, underscored.end(), '-', '_');
  if (underscored != spellings.front()) spellings.push_back(underscored);
  if (flag.short_name != 0) spellings.push_back(std::string("-") + flag.short_name);
  return spellings;
}

// torchrun's --tee takes a stream spec ("3", "0:1,1:3"); a bare --tee means both streams.
constexpr const char* kTeeBare = "3";
bool is_stream_spec(const std::string& word) {
  return !word.empty() && word.find_first_not_of("0123456789:,") == std::string::npos;
}

// ddprun's flags as CLI11 options. Each spelling is an option of its own, so that a message
// names the spelling the user wrote ("'-3' for --nproc_per_node"); CLI11 2.1 keeps no record of
// which name of an option matched.
struct Grammar {
  CLI::App app{"ddprun"};
  std::map<const CLI::Option*, const FlagSpec*> flag_of;  // -h/--help is not in it

  Grammar() {
    // CLI11 stops at PROGRAM and leaves it, with everything after it, in remaining().
    app.prefix_command();
    for (const FlagSpec& flag : kFlags) {
      for (const std::string& spelling : spellings_of(flag)) {
        CLI::Option* option = flag.kind == FlagKind::kSwitch ? app.add_flag(spelling) : app.add_option(spelling);
        // Every occurrence is kept, for the last one to win in command-line order.
        option->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
        flag_of[option] = &flag;
      }
    }
  }

  // The flag `option` spells; nullptr for -h/--help.
  const FlagSpec* flag(const CLI::Option* option) const {
    const auto entry = flag_of.find(option);
    return entry == flag_of.end() ? nullptr : entry->second;
  }
};

// CLI11 2.1 reads a few words differently from torchrun's argparse, whose reading ddprun keeps:
//  - "--flag=" is an empty value; CLI11 takes the next word as the value instead.
//  - "--flag --other" is a missing value; CLI11 takes "--other" as the value.
//  - --tee/-t takes the next word only if it is a stream spec, so that "--tee PROGRAM" still
//    starts PROGRAM; CLI11 has no test on the word an optional value would take.
//  - "--switch=VALUE" and "-mX" are errors; CLI11 takes VALUE as the switch's value, and X as
//    more one-letter switches.
//  - -h/--help prints the help as soon as it is read; CLI11 reads the words after it first and
//    may refuse one of them.
// So this walk goes over the options before CLI11 does, knowing each option from CLI11's own
// table, throws those errors, and rewrites those words into ones CLI11 reads as argparse does:
// "--flag" "" and "--tee=3". It stops where the options end: at "--", at PROGRAM, or at an
// option CLI11 does not know, which CLI11 leaves in remaining() for parse_command_line to name.
std::vector<std::string> argparse_words(const Grammar& grammar, std::vector<std::string> words) {
  for (size_t i = 0; i < words.size(); ++i) {
    const std::string word = words[i];
    if (word == "--" || word.size() < 2 || word[0] != '-') break;
    // "--flag=VALUE" or "--flag"; "-rVALUE" or "-r".
    const bool is_long = word[1] == '-';
    const std::string spelled = is_long ? word.substr(0, word.find('=')) : word.substr(0, 2);
    const bool value_attached = word.size() > spelled.size();
    const CLI::Option* option = grammar.app.get_option_no_throw(spelled);
    if (option == nullptr) break;
    const FlagSpec* flag = grammar.flag(option);
    const bool is_switch = flag == nullptr || flag->kind == FlagKind::kSwitch;
    if (is_switch && value_attached) throw UsageError("option " + spelled + " takes no value, got '" + word + "'");
    if (flag == nullptr) {  // -h/--help
      words.resize(i + 1);
      break;
    }
    if (is_switch) continue;
    if (value_attached) {
      if (is_long && word.size() == spelled.size() + 1) {  // "--flag="
        words[i] = spelled;
        words.insert(words.begin() + static_cast<std::ptrdiff_t>(i) + 1, "");
        ++i;
      }
      continue;
    }
    // A following "--something" is the next option, not this one's value.
    const bool value_follows = i + 1 < words.size() && words[i + 1].compare(0, 2, "--") != 0;
    if (flag->kind == FlagKind::kOptionalValue && !(value_follows && is_stream_spec(words[i + 1]))) {
      words[i] = spelled + (is_long ? "=" : "") + kTeeBare;
      continue;
    }
    if (!value_follows) throw UsageError("option " + spelled + " needs a value");
    ++i;
  }
  return words;
}

// A flag's value and where it came from ("--nproc_per_node", "PET_NPROC_PER_NODE").
struct GivenValue {
  std::string label;
  std::string value;  // a switch: "1" on, "0" off
};

// Each flag's value as argparse would have it: the last word for a flag wins, whichever of its
// spellings it used.
std::map<std::string, GivenValue> given_on_command_line(const Grammar& grammar) {
  std::map<std::string, GivenValue> given;
  std::map<const CLI::Option*, size_t> occurrences;
  for (const CLI::Option* option : grammar.app.parse_order()) {
    const FlagSpec* flag = grammar.flag(option);
    if (flag == nullptr) continue;
    const std::string& value = option->results().at(occurrences[option]++);
    given[applied_as(*flag)] = GivenValue{option->get_name(), flag->kind == FlagKind::kSwitch ? "1" : value};
  }
  return given;
}

// torchrun's `env` and `check_env` actions: a flag left out takes PET_<NAME>. CLI11's envname()
// cannot stand in: with an option per spelling it would fill in "--nproc-per-node" when the
// command line gave "--nproc_per_node", it reads a switch's variable as a word rather than as
// check_env's integer, and its messages would not name the variable.
void add_environment_defaults(std::map<std::string, GivenValue>& given) {
  for (const FlagSpec& flag : kFlags) {
    if (flag.env_default != EnvDefault::kPet || given.count(flag.name) != 0) continue;
    const std::string name = pet_name(flag.name);
    const char* text = std::getenv(name.c_str());
    // Empty counts as unset: a pod template that blanks a variable means "no value".
    if (text == nullptr || *text == '\0') continue;
    std::string value = text;
    if (flag.kind == FlagKind::kSwitch) value = parse_env_switch(name, value) ? "1" : "0";
    given[flag.name] = GivenValue{name, value};
  }
}

// An option CLI11 did not know stays first in remaining(), before PROGRAM: "-x", "--bogus=1".
// Words that CLI11 reads as PROGRAM but are shaped like options ("-3", "---x") count too, as
// they did for argparse.
void refuse_unknown_option(const std::vector<std::string>& remaining) {
  if (remaining.empty()) return;
  const std::string& word = remaining.front();
  if (word == "--" || word.size() < 2 || word[0] != '-') return;
  throw UsageError("unknown option '" + (word[1] == '-' ? word.substr(0, word.find('=')) : word) + "'");
}

}  // namespace

CommandLine parse_command_line(const std::vector<std::string>& args) {
  Grammar grammar;
  std::vector<std::string> words = argparse_words(grammar, args);
  std::reverse(words.begin(), words.end());  // CLI11 reads the words from the back
  bool help = false;
  std::string cli11_error;
  try {
    grammar.app.parse(words);
  } catch (const CLI::CallForHelp&) {
    help = true;
  } catch (const CLI::ParseError& error) {
    cli11_error = error.what();
  }
  // An unknown option comes before anything CLI11 read after it, help included.
  std::vector<std::string> program = grammar.app.remaining();
  refuse_unknown_option(program);
  CommandLine result;
  if (help) {
    result.show_help = true;
    return result;
  }
  // argparse_words() leaves CLI11 nothing to refuse before an unknown option; this is a guard.
  if (!cli11_error.empty()) throw UsageError(cli11_error);

  std::map<std::string, GivenValue> given = given_on_command_line(grammar);
  add_environment_defaults(given);
  LaunchOptions& options = result.options;
  for (const FlagSpec& flag : kFlags) {
    const auto entry = given.find(flag.name);
    if (entry == given.end()) continue;
    const GivenValue& source = entry->second;
    if (flag.kind == FlagKind::kSwitch) {
      apply_switch(options, flag.name, source.label, source.value == "1");
    } else {
      apply_value(options, flag.name, source.label, source.value);
    }
  }

  if (options.rdzv_backend == "static" && !options.rdzv_endpoint.empty()) {
    // As torchrun: with the static backend the endpoint is the master's address and port.
    const size_t colon = options.rdzv_endpoint.rfind(':');
    options.master_addr = options.rdzv_endpoint.substr(0, colon);
    if (colon != std::string::npos) options.master_port = std::atoi(options.rdzv_endpoint.c_str() + colon + 1);
  }
  if (!program.empty() && program.front() == "--") program.erase(program.begin());
  options.command = std::move(program);
  try {
    validate(options);
  } catch (const std::invalid_argument& error) {
    throw UsageError(error.what());
  }
  return result;
}

}  // namespace ddprun
