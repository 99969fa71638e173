// The instruction-set level of the CPU kernels, detected at run time, never a build flag: one binary
// runs the best path the CPU it lands on has. PYPRUNE_MAX_CPU_ISA (or limit_cpu_isa) caps the level,
// as ONEDNN_MAX_CPU_ISA does for oneDNN, so every path can be tested and timed on a machine that has
// a higher one.
#pragma once

#include <string>

namespace pyprune_cpu {

// Ordered: each level has every instruction of the ones below it.
enum class CpuIsa : int {
  kGeneric = 0,     // portable C++ (the compiler's own vectorisation)
  kAvx2 = 1,        // AVX2 + FMA + F16C
  kAvx512 = 2,      // + AVX512F (vexpandps)
  kAvx512Bf16 = 3,  // + AVX512BW, AVX512_VBMI2 (vpexpandw) and AVX512_BF16 (vdpbf16ps)
};

// The highest level this CPU has.
CpuIsa detected_cpu_isa();
// min(detected, the cap): the level the kernels run.
CpuIsa cpu_isa();
const char* cpu_isa_name(CpuIsa isa);
// The AVX2 + FMA + F16C kernels may run.
inline bool cpu_has_avx2() { return cpu_isa() >= CpuIsa::kAvx2; }
// Parses "generic" | "avx2" | "avx512" | "avx512_bf16"; raises naming the allowed values.
CpuIsa parse_cpu_isa(const std::string& name, const char* what);

}  // namespace pyprune_cpu
