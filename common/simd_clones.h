// MUOND_ELEMENTWISE_CLONES: compiles an element-wise loop twice, for AVX2 and for the x86-64
// baseline, and the loader picks the one the CPU runs (GCC's target_clones). AVX2 alone enables no
// fused multiply-add, so both round exactly alike and like the CUDA kernels. Other compilers and
// architectures get the one baseline version.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MUOND_ELEMENTWISE_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define MUOND_ELEMENTWISE_CLONES
#endif
