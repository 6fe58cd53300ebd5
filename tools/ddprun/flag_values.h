// The values of ddprun's flags: each check turns the text given for one flag, on the command
// line or in a PET_* variable, into LaunchOptions, or throws UsageError naming where the text
// came from. The grammar that finds the text is command_line.cpp's.
#pragma once

#include <string>

#include "command_line.h"

namespace ddprun {

// Sets the switch `canonical` ("standalone", "no-prefix", ...) on or off. `label` names where it
// came from ("-m", "PET_MODULE"). Throws UsageError for torchrun switches ddprun refuses
// (--module, --run-path).
void apply_switch(LaunchOptions& options, const std::string& canonical, const std::string& label, bool on);

// Checks `value` for the flag `canonical` ("nproc-per-node", ...; --run-id arrives as
// "rdzv-id") and stores it. Throws UsageError("invalid value 'VALUE' for LABEL: what is
// expected").
void apply_value(LaunchOptions& options, const std::string& canonical, const std::string& label,
                 const std::string& value);

// A switch's PET_* variable, read as torchrun's check_env reads it: bool(int(value)). Throws
// UsageError unless `value` is an integer.
bool parse_env_switch(const std::string& name, const std::string& value);

}  // namespace ddprun
