// The instruction-set level of the CPU kernels (cpu_isa.h), detected once, capped at will.
#include "cpu_isa.h"
#include "ops.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>

#if defined(__x86_64__) || defined(_M_X64)
#define PYPRUNE_ISA_X86 1
#endif

namespace pyprune_cpu {

namespace {
#ifdef PYPRUNE_ISA_X86
CpuIsa detect() {
  __builtin_cpu_init();
  if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")))
    return CpuIsa::kGeneric;
  if (!__builtin_cpu_supports("avx512f")) return CpuIsa::kAvx2;
  const bool bf16 = __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vbmi2") &&
                    __builtin_cpu_supports("avx512bf16");
  return bf16 ? CpuIsa::kAvx512Bf16 : CpuIsa::kAvx512;
}
#else
CpuIsa detect() { return CpuIsa::kGeneric; }
#endif

constexpr const char* kIsaNames[] = {"generic", "avx2", "avx512", "avx512_bf16"};

// The cap: PYPRUNE_MAX_CPU_ISA at first use, then limit_cpu_isa.
std::atomic<int>& isa_limit() {
  static std::atomic<int> limit{[] {
    const char* env = std::getenv("PYPRUNE_MAX_CPU_ISA");
    return static_cast<int>(env && *env ? parse_cpu_isa(env, "PYPRUNE_MAX_CPU_ISA") : CpuIsa::kAvx512Bf16);
  }()};
  return limit;
}
}  // namespace

CpuIsa detected_cpu_isa() {
  static const CpuIsa isa = detect();
  return isa;
}

CpuIsa cpu_isa() {
  return static_cast<CpuIsa>(std::min(static_cast<int>(detected_cpu_isa()), isa_limit().load()));
}

const char* cpu_isa_name(CpuIsa isa) { return kIsaNames[static_cast<int>(isa)]; }

CpuIsa parse_cpu_isa(const std::string& name, const char* what) {
  for (int level = 0; level < 4; ++level)
    if (name == kIsaNames[level]) return static_cast<CpuIsa>(level);
  TORCH_CHECK_VALUE(false, what, " must be one of generic, avx2, avx512, avx512_bf16; got '", name, "'");
}

std::string cpu_isa_report(bool detected) {
  return cpu_isa_name(detected ? detected_cpu_isa() : cpu_isa());
}

std::string limit_cpu_isa(const std::string& name) {
  const int previous = isa_limit().exchange(static_cast<int>(parse_cpu_isa(name, "limit_cpu_isa: isa")));
  return kIsaNames[previous];
}

}  // namespace pyprune_cpu
