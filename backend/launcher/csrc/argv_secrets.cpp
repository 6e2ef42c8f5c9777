// Preloaded into tritonserver by splitfuse.launcher (hidden_args.py) so that secrets never sit
// on its command line, where `ps` and /proc/<pid>/cmdline show them to every local user.
//
// An argument may hold "{splitfuse-secret:NAME}"; before main() parses the arguments, this
// library replaces it with the value of $SPLITFUSE_SECRET_NAME in a copy of the argument.
// /proc/<pid>/cmdline keeps showing the original memory, so the placeholder; main() sees the
// copy. The secret variables are then removed from the environment and their bytes zeroed, and
// LD_PRELOAD is put back as it was, so the Python-backend stubs Triton starts inherit neither.
// A placeholder whose variable is missing stops the process: a key left as the placeholder
// text would be a key everyone knows.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <unistd.h>
#include <vector>

extern char** environ;

namespace {

constexpr char kOpen[] = "{splitfuse-secret:";
constexpr char kEnvPrefix[] = "SPLITFUSE_SECRET_";
constexpr char kPreloadBefore[] = "SPLITFUSE_LD_PRELOAD_BEFORE";

bool fill(const char* arg, std::string& out) {
  out.assign(arg);
  bool changed = false;
  size_t at, from = 0;
  // The search goes on after each value put in: a value holding a placeholder is not expanded
  // again (it would be forever when it holds its own).
  while ((at = out.find(kOpen, from)) != std::string::npos) {
    const size_t name_at = at + sizeof(kOpen) - 1;
    const size_t end = out.find('}', name_at);
    if (end == std::string::npos) break;
    const std::string name = out.substr(name_at, end - name_at);
    const char* value = getenv((kEnvPrefix + name).c_str());
    if (value == nullptr || *value == '\0') {
      fprintf(stderr, "splitfuse argv_secrets: $%s%s is not set; refusing to start\n", kEnvPrefix, name.c_str());
      _exit(2);
    }
    out.replace(at, end - at + 1, value);
    from = at + strlen(value);
    changed = true;
  }
  return changed;
}

void forget_secrets() {
  std::vector<std::string> names;
  std::vector<char*> entries;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    if (strncmp(*e, kEnvPrefix, sizeof(kEnvPrefix) - 1) == 0) {
      const char* eq = strchr(*e, '=');
      names.emplace_back(*e, eq ? static_cast<size_t>(eq - *e) : strlen(*e));
      entries.push_back(*e);
    }
  }
  for (const std::string& name : names) unsetenv(name.c_str());
  for (char* entry : entries) memset(entry, 0, strlen(entry));
  const char* before = getenv(kPreloadBefore);
  if (before != nullptr && *before != '\0') {
    setenv("LD_PRELOAD", before, 1);
  } else {
    unsetenv("LD_PRELOAD");
  }
  unsetenv(kPreloadBefore);
}

// glibc calls .init_array entries of preloaded libraries with main's argc, argv and envp.
void fill_arguments(int argc, char** argv, char** /*envp*/) {
  std::string filled;
  for (int i = 1; i < argc; ++i) {
    if (fill(argv[i], filled)) argv[i] = strdup(filled.c_str());
  }
  forget_secrets();
}

}  // namespace

__attribute__((section(".init_array"), used)) static void (*const splitfuse_fill_arguments)(int, char**, char**) =
    &fill_arguments;
