#pragma once

// Internal, not API: the pieces of reading the environment that the process
// group and the backends share with env.cpp, and that the tests check.

#include <ddp/env.h>

#include <string>

namespace ddp {

// The first host of a SLURM host list: "node[03-05,9],gpu1" -> "node03".
std::string first_host_of_slurm_nodelist(const std::string& nodelist);

// Parses an environment variable's value as an integer, or throws an error
// that names the variable.
int parse_int_env(const std::string& name, const std::string& value);

// Checks that a world of several ranks knows its master (MASTER_ADDR and
// MASTER_PORT), as the TCPStore rendezvous needs; the mpi backend does not.
void require_master(const World& world);

}  // namespace ddp
