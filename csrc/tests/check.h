// A minimal check macro for the standalone C++ tests (no test framework to install): counts
// failures, prints each with its location, and main() returns the count.
#pragma once

#include <cstdio>

namespace fa_test {
inline int failures = 0;
}

#define CHECK(cond, ...)                                                  \
  do {                                                                    \
    if (!(cond)) {                                                        \
      ++fa_test::failures;                                                \
      std::fprintf(stderr, "%s:%d: CHECK(%s) failed: ", __FILE__, __LINE__, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                                  \
      std::fprintf(stderr, "\n");                                         \
    }                                                                     \
  } while (0)

#define TEST_MAIN(...)                                                    \
  int main() {                                                            \
    __VA_ARGS__;                                                          \
    std::printf("%s: %d failure(s)\n", __FILE__, fa_test::failures);     \
    return fa_test::failures == 0 ? 0 : 1;                                \
  }
