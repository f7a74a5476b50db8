// The same tests as test_math.cpp, compiled by nvcc: math.h's __host__ __device__ functions must
// compile there and give the same results on the host side.
#define FA_PATTERN_STRIDE 17
#include "test_math.cpp"
