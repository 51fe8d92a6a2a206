// Every float through the 8-bit kernel's divisions, against the divider (the generic path):
// divide_by_scalar_cpu (the step's divisions by its bias corrections) bit for bit, and
// quantize_scaled_cpu (its requantization by a block scale) code for code, for the divisors and
// scales below, on the widest ISA this CPU runs. 2^32 values per divisor: minutes, so not part of CTest
// (tests/optim/test_optim.cpp samples the same sweep); docs/cpu.md has the last result.
//
//   build/tests/optstate_check_division [--quick] [divisor...]   (--quick: every 61st float; divisors
//   given replace the list below, e.g. 1 for the quantizer alone on every float)
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "adamw8bit_kernel.h"

using namespace optstate;
using namespace optstate::optim;

int main(int argc, char** argv) {
  const bool quick = argc > 1 && !std::strcmp(argv[1], "--quick");
  const uint64_t stride = quick ? 61 : 1;
  // AVX-512 is the path that does not always divide; the AVX2 one is checked where it is the widest.
  std::vector<CpuIsa> isas;
  if (cpu_has(CpuIsa::kAvx512)) isas.insert(isas.end(), {CpuIsa::kAvx512, CpuIsa::kAvx512Gather});
  else if (cpu_has(CpuIsa::kAvx2)) isas.push_back(CpuIsa::kAvx2);
  // Bias corrections of the usual betas (1 - 0.9^t, sqrt(1 - 0.999^t)), divisors whose mantissa is
  // all ones or just above a power of two, the 1e-12 clip, the scale range's edges, random ones.
  std::vector<float> divisors{0.1f, 0.19f, 0.271f, 0.0316227766f, 0.0447101f, 1.0f, 0.5f, 3.0f, 1e-12f,
                              0x1.fffffep-1f, 0x1.fffffep+0f, 0x1.000002p0f, 0x1.7ffffep-3f, 0x1p-64f, 0x1p126f};
  std::mt19937 rng(58);
  for (int k = 0; k < 8; ++k) divisors.push_back(std::ldexp(std::uniform_real_distribution<float>(1, 2)(rng), -40 + 10 * k));
  if (argc > 1 + quick) {
    divisors.clear();
    for (int k = 1 + quick; k < argc; ++k) divisors.push_back(std::strtof(argv[k], nullptr));
  }
  const size_t chunk = size_t{1} << 22;
  std::vector<float> a(chunk), q(chunk), ref(chunk);
  std::vector<uint8_t> codes(chunk), ref_codes(chunk);
  int failed = 0;
  for (float b : divisors) {
    for (CpuIsa isa : isas) {
      uint64_t bad_div = 0, bad_code[2] = {0, 0}, n = 0;
      for (uint64_t base = 0; base < (uint64_t{1} << 32); base += chunk * stride) {
        size_t len = 0;
        for (uint64_t u = base; u < base + chunk * stride && u < (uint64_t{1} << 32); u += stride) {
          const uint32_t bits = static_cast<uint32_t>(u);
          std::memcpy(&a[len++], &bits, 4);
        }
        const std::span<const float> in(a.data(), len);
        if (isa != CpuIsa::kAvx512Gather) {  // the two AVX-512 paths differ only in their quantizer
          divide_by_scalar_cpu(in, b, std::span(q.data(), len), isa);
          divide_by_scalar_cpu(in, b, std::span(ref.data(), len), CpuIsa::kGeneric);
          for (size_t i = 0; i < len; ++i) bad_div += std::memcmp(&q[i], &ref[i], 4) != 0;  // NaNs' bits too
        }
        for (int m = 0; m < 2; ++m) {
          const QMap map = m ? QMap::kDynamicUnsigned : QMap::kDynamicSigned;
          quantize_scaled_cpu(in, map, std::span(codes.data(), len), isa, b);
          quantize_scaled_cpu(in, map, std::span(ref_codes.data(), len), CpuIsa::kGeneric, b);
          for (size_t i = 0; i < len; ++i) bad_code[m] += codes[i] != ref_codes[i];
        }
        n += len;
      }
      std::printf("%-8s divisor %-16a %llu floats: %llu quotients, %llu signed and %llu unsigned codes differ\n",
                  isa == CpuIsa::kAvx512 ? "avx512" : isa == CpuIsa::kAvx512Gather ? "avx512-g" : "avx2", b, static_cast<unsigned long long>(n),
                  static_cast<unsigned long long>(bad_div), static_cast<unsigned long long>(bad_code[0]),
                  static_cast<unsigned long long>(bad_code[1]));
      std::fflush(stdout);
      failed += bad_div + bad_code[0] + bad_code[1] != 0;
    }
  }
  std::printf("%s\n", failed ? "FAILED" : "all equal");
  return failed ? 1 : 0;
}
