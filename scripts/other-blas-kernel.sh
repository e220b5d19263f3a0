#!/usr/bin/env bash
# Prints the OpenBLAS kernel (an OPENBLAS_CORETYPE value) that scripts/test.sh runs the
# numerics-sensitive tests under a second time: one other than the machine's own, that this CPU can
# run, and that sums GEMMs differently. The rule:
#   the machine's own kernel uses AVX-512 (SkylakeX, Cooperlake, SapphireRapids) → Haswell (AVX2+FMA);
#   the CPU has AVX2 and FMA (Haswell, Zen, …)                                   → Sandybridge (AVX, no FMA);
#   otherwise                                                                   → Prescott (SSE3).
# The machine's own is the kernel the daemon runs ($MUOND_BINARY --print-blas-kernel, when given: it
# may start again under a better one than OpenBLAS picks), else OpenBLAS's pick.
# $MUOND_OTHER_BLAS_KERNEL overrides it. --why prints the reason instead.
set -euo pipefail
if [[ -n ${MUOND_BINARY:-} && -x $MUOND_BINARY ]]; then
  own=$("$MUOND_BINARY" --print-blas-kernel 2>/dev/null || echo unknown)
else
  own=$(/usr/bin/python3 -c '
import ctypes
blas = ctypes.CDLL("libopenblas.so.0")
blas.openblas_get_corename.restype = ctypes.c_char_p
print(blas.openblas_get_corename().decode())' 2>/dev/null || echo unknown)
fi
flags=$(grep -m1 '^flags' /proc/cpuinfo || true)
if [[ -n ${MUOND_OTHER_BLAS_KERNEL:-} ]]; then
  kernel=$MUOND_OTHER_BLAS_KERNEL why="set by MUOND_OTHER_BLAS_KERNEL; this machine's own is $own"
elif [[ $own =~ ^(SkylakeX|Cooperlake|SapphireRapids)$ ]]; then
  kernel=Haswell why="this machine's own is $own, an AVX-512 kernel"
elif [[ $flags == *" avx2 "* && $flags == *" fma "* ]]; then
  kernel=Sandybridge why="this machine's own is $own, with AVX2 and FMA"
else
  kernel=Prescott why="this machine's own is $own, without AVX2"
fi
if [[ ${1:-} == --why ]]; then echo "$why"; else echo "$kernel"; fi
