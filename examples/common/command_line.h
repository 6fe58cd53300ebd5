#pragma once

// How the example programs read their command line, on CLI11: a help that
// lists every flag with its default, checks that name the flag and the bad
// value, and one kind of error (UsageError) that main() prints with the usage
// before it exits with status 2.

#include <CLI/CLI.hpp>

#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace examples {

/// A command line the program cannot run with: main() prints the message and
/// the usage, and exits 2.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// CLI11's help in the examples' layout: "usage: PROGRAM [OPTIONS] ARGS", then
/// a line per flag with its value's name and its default,
/// "  --batch-size N   samples per batch on each process (default 32)".
class HelpFormatter : public CLI::Formatter {
 public:
  HelpFormatter() {
    label("Usage", "usage");
    column_width(27);
  }

  std::string make_option_opts(const CLI::Option* option) const override {
    if (option->get_positional() || option->get_type_size() == 0) return "";
    return " " + option->get_type_name();
  }

  std::string make_option_desc(const CLI::Option* option) const override {
    const std::string& fallback = option->get_default_str();
    if (option->get_positional() || fallback.empty()) return option->get_description();
    return option->get_description() + " (default " + fallback + ")";
  }
};

// The checks below throw their UsageError rather than return a message:
// CLI11 would put "FLAG: " before a returned one, and these words are the
// programs' own (their tests read them).

/// A CLI11 transform for an integer that must be > 0: "--batch-size must be
/// positive, got 0". Decimal only: CLI11 alone would read 010 as octal.
inline CLI::Validator positive_integer(std::string what) {
  return CLI::Validator(
      [what](std::string& text) {
        char* end = nullptr;
        errno = 0;
        const long long value = std::strtoll(text.c_str(), &end, 10);
        if (text.empty() || *end != '\0' || errno == ERANGE) {
          throw UsageError(what + " must be an integer, got '" + text + "'");
        }
        if (value <= 0) throw UsageError(what + " must be positive, got " + text);
        text = std::to_string(value);
        return std::string();
      },
      "");
}

/// A CLI11 transform for an integer that must be >= 0: "--seed must be a
/// non-negative integer, got '-3'". Decimal only.
inline CLI::Validator non_negative_integer(std::string what) {
  return CLI::Validator(
      [what](std::string& text) {
        char* end = nullptr;
        errno = 0;
        const unsigned long long value = std::strtoull(text.c_str(), &end, 10);
        // strtoull reads "-3" as 2^64 - 3.
        if (text.empty() || *end != '\0' || errno == ERANGE || text.find('-') != std::string::npos) {
          throw UsageError(what + " must be a non-negative integer, got '" + text + "'");
        }
        text = std::to_string(value);
        return std::string();
      },
      "");
}

/// A CLI11 check that the value is one of `choices`: "--device must be cpu,
/// cuda or auto, got 'gpu'".
inline CLI::Validator one_of(std::string what, std::vector<std::string> choices) {
  std::string listed;
  for (size_t i = 0; i < choices.size(); ++i) {
    listed += (i == 0 ? "" : i + 1 == choices.size() ? " or " : ", ") + choices[i];
  }
  return CLI::Validator(
      [what, choices, listed](std::string& text) {
        for (const auto& choice : choices) {
          if (text == choice) return std::string();
        }
        throw UsageError(what + " must be " + listed + ", got '" + text + "'");
      },
      "");
}

/// A CLI11 app set up as every example's: the help above on -h/--help, each
/// flag's default shown there, and a repeated flag's last value winning.
class CommandLine : public CLI::App {
 public:
  CommandLine(std::string description, std::string program) : CLI::App(std::move(description), std::move(program)) {
    formatter(std::make_shared<HelpFormatter>());
    set_help_flag("-h,--help", "show this help");
    option_defaults()->always_capture_default()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  }

  /// Parses argv into the variables the options are bound to. --help prints
  /// the help on stderr and exits 0; a command line CLI11 refuses is thrown
  /// as a UsageError.
  void read(int argc, char** argv) {
    try {
      parse(argc, argv);
    } catch (const CLI::CallForHelp&) {
      std::cerr << help();
      std::exit(0);
    } catch (const CLI::RequiredError&) {
      throw UsageError(missing_positionals());
    } catch (const CLI::ExtrasError&) {
      const std::string extra = remaining().front();
      const bool looks_like_flag =
          extra.size() > 1 && extra[0] == '-' && !std::isdigit(static_cast<unsigned char>(extra[1]));
      throw UsageError(looks_like_flag ? "unknown option " + extra : "unexpected argument '" + extra + "'");
    } catch (const CLI::ArgumentMismatch& e) {
      // CLI11's "--metrics: 1 required TEXT missing": the arguments ended
      // before the flag's value.
      const std::string message = e.what();
      if (message.size() > 8 && message.compare(message.size() - 8, 8, " missing") == 0) {
        throw UsageError(message.substr(0, message.find(':')) + " needs a value");
      }
      throw UsageError(message);
    } catch (const CLI::ParseError& e) {
      throw UsageError(e.what());
    }
  }

 private:
  // "TOTAL_EPOCHS and SAVE_EVERY are required": all required positionals,
  // as they are required together.
  std::string missing_positionals() const {
    std::vector<std::string> names;
    for (const CLI::Option* option : get_options()) {
      if (option->get_positional() && option->get_required()) names.push_back(option->get_name());
    }
    if (names.size() == 1) return names[0] + " is required";
    std::string listed;
    for (size_t i = 0; i < names.size(); ++i) {
      listed += (i == 0 ? "" : i + 1 == names.size() ? " and " : ", ") + names[i];
    }
    return listed + " are required";
  }
};

}  // namespace examples
