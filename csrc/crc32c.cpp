// CRC32C; the contract is in crc32c.h. Three ways, the fastest the CPU has is used:
// - "avx512": carry-less multiplication folds 64-byte vectors (Note [folding a crc]); about
//   twice the crc32 instruction's rate, so reading memory, not the arithmetic, bounds it.
// - "sse4.2" follows Mark Adler's crc32c.c (zlib licence): three streams of kLong (then kShort)
//   bytes run through the crc32 instruction side by side, which hides its three-cycle latency,
//   and are joined by multiplying the earlier streams' crcs by x^(8 * length) with tables.
// - "portable": slicing-by-8 tables.
#include "crc32c.h"

#include <cstring>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define ACTOFF_CRC32C_X86 1
#endif

namespace actoff {
namespace {

constexpr std::uint32_t kPoly = 0x82f63b78;  // reflected Castagnoli polynomial
constexpr std::size_t kLong = 8192;
constexpr std::size_t kShort = 256;

struct Tables {
  std::uint32_t slice[8][256];  // slicing-by-8, for the portable path
  std::uint32_t long_shift[4][256];  // x^(8 * kLong) times a crc, byte by byte
  std::uint32_t short_shift[4][256];
  // Folding constants, two 64-bit words per distance of 128, 512 and 2048 bits (Note [folding
  // a crc]): {reflect64(x^(D+63) mod P), reflect64(x^(D-1) mod P)}.
  alignas(16) std::uint64_t fold128[2], fold512[2], fold2048[2];
  bool hardware = false;
  bool avx512 = false;

  Tables() {
    for (std::uint32_t n = 0; n < 256; ++n) {
      std::uint32_t crc = n;
      for (int k = 0; k < 8; ++k) crc = crc & 1 ? (crc >> 1) ^ kPoly : crc >> 1;
      slice[0][n] = crc;
    }
    for (std::uint32_t n = 0; n < 256; ++n) {
      std::uint32_t crc = slice[0][n];
      for (int k = 1; k < 8; ++k) {
        crc = slice[0][crc & 0xff] ^ (crc >> 8);
        slice[k][n] = crc;
      }
    }
    shift_tables(long_shift, kLong);
    shift_tables(short_shift, kShort);
    fold_constants(fold128, 128);
    fold_constants(fold512, 512);
    fold_constants(fold2048, 2048);
#ifdef ACTOFF_CRC32C_X86
    __builtin_cpu_init();  // this runs among the static constructors, maybe before libgcc's
    hardware = __builtin_cpu_supports("sse4.2");
    avx512 = hardware && __builtin_cpu_supports("avx512f") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("vpclmulqdq") &&
             __builtin_cpu_supports("pclmul");
#endif
  }

  // x^n mod P, P the Castagnoli polynomial in its usual (not reflected) order, x^32 implied.
  static std::uint32_t x_power_mod(std::size_t n) {
    std::uint32_t remainder = 1;  // x^0
    for (; n; --n) remainder = (remainder << 1) ^ (remainder & 0x80000000u ? 0x1EDC6F41u : 0u);
    return remainder;
  }

  static std::uint64_t reflect64(std::uint64_t word) {
    std::uint64_t out = 0;
    for (int bit = 0; bit < 64; ++bit, word >>= 1) out = (out << 1) | (word & 1);
    return out;
  }

  static void fold_constants(std::uint64_t* out, std::size_t distance_bits) {
    out[0] = reflect64(x_power_mod(distance_bits + 63));
    out[1] = reflect64(x_power_mod(distance_bits - 1));
  }

  // Over GF(2): a 32x32 matrix (one column per bit) times a vector.
  static std::uint32_t times(const std::uint32_t* matrix, std::uint32_t vector) {
    std::uint32_t sum = 0;
    for (; vector; vector >>= 1, ++matrix)
      if (vector & 1) sum ^= *matrix;
    return sum;
  }

  static void square(std::uint32_t* out, const std::uint32_t* matrix) {
    for (int n = 0; n < 32; ++n) out[n] = times(matrix, matrix[n]);
  }

  // The operator that appends `nbytes` zero bytes to a crc (nbytes a power of two).
  static void zeros_operator(std::uint32_t* even, std::size_t nbytes) {
    std::uint32_t odd[32];
    odd[0] = kPoly;  // one zero bit
    for (int n = 1; n < 32; ++n) odd[n] = 1u << (n - 1);
    square(even, odd);  // two zero bits
    square(odd, even);  // four
    do {
      square(even, odd);  // eight, then 32, 128, ...
      nbytes >>= 1;
      if (nbytes == 0) return;
      square(odd, even);
      nbytes >>= 1;
    } while (nbytes);
    std::memcpy(even, odd, sizeof(odd));
  }

  static void shift_tables(std::uint32_t table[4][256], std::size_t nbytes) {
    std::uint32_t op[32];
    zeros_operator(op, nbytes);
    for (std::uint32_t n = 0; n < 256; ++n)
      for (int k = 0; k < 4; ++k) table[k][n] = times(op, n << (8 * k));
  }
};

const Tables kTables;

std::uint32_t shift(const std::uint32_t table[4][256], std::uint32_t crc) {
  return table[0][crc & 0xff] ^ table[1][(crc >> 8) & 0xff] ^ table[2][(crc >> 16) & 0xff] ^
         table[3][crc >> 24];
}

std::uint64_t load64(const unsigned char* at) {
  std::uint64_t word;
  std::memcpy(&word, at, 8);  // unaligned, without undefined behaviour
  return word;
}

std::uint32_t crc32c_portable(std::uint32_t crc, const unsigned char* next, std::size_t nbytes) {
  const auto& t = kTables.slice;
  crc = ~crc;
  while (nbytes >= 8) {
    const std::uint64_t word = load64(next) ^ crc;  // little-endian hosts
    crc = t[7][word & 0xff] ^ t[6][(word >> 8) & 0xff] ^ t[5][(word >> 16) & 0xff] ^
          t[4][(word >> 24) & 0xff] ^ t[3][(word >> 32) & 0xff] ^ t[2][(word >> 40) & 0xff] ^
          t[1][(word >> 48) & 0xff] ^ t[0][word >> 56];
    next += 8;
    nbytes -= 8;
  }
  while (nbytes--) crc = t[0][(crc ^ *next++) & 0xff] ^ (crc >> 8);
  return ~crc;
}

#ifdef ACTOFF_CRC32C_X86
__attribute__((target("sse4.2"))) std::uint32_t crc32c_sse42(std::uint32_t crc,
                                                             const unsigned char* next,
                                                             std::size_t nbytes) {
  std::uint64_t crc0 = ~crc;
  while (nbytes && (reinterpret_cast<std::uintptr_t>(next) & 7) != 0) {
    crc0 = _mm_crc32_u8(static_cast<std::uint32_t>(crc0), *next++);
    --nbytes;
  }
  for (std::size_t block : {kLong, kShort}) {
    const auto& table = block == kLong ? kTables.long_shift : kTables.short_shift;
    while (nbytes >= 3 * block) {
      std::uint64_t crc1 = 0, crc2 = 0;
      const unsigned char* end = next + block;
      do {
        crc0 = _mm_crc32_u64(crc0, load64(next));
        crc1 = _mm_crc32_u64(crc1, load64(next + block));
        crc2 = _mm_crc32_u64(crc2, load64(next + 2 * block));
        next += 8;
      } while (next < end);
      crc0 = shift(table, static_cast<std::uint32_t>(crc0)) ^ crc1;
      crc0 = shift(table, static_cast<std::uint32_t>(crc0)) ^ crc2;
      next += 2 * block;
      nbytes -= 3 * block;
    }
  }
  for (; nbytes >= 8; nbytes -= 8, next += 8) crc0 = _mm_crc32_u64(crc0, load64(next));
  while (nbytes--) crc0 = _mm_crc32_u8(static_cast<std::uint32_t>(crc0), *next++);
  return ~static_cast<std::uint32_t>(crc0);
}

// Note [folding a crc]: a reflected CRC is the message, a polynomial over GF(2), times x^32
// modulo P, and only the remainder matters. A 128-bit block A = L*x^64 + H standing D bits
// before the end of a later block can move there as A*x^D == L*(x^(D+64) mod P) +
// H*(x^D mod P): two carry-less 64x32-bit products of at most 96 bits, XORed into that block.
// Memory holds each 64-bit half bit-reflected (bit i is the coefficient of x^(63-i)), and the
// carry-less product of two reflected words comes out reflected over 128 bits times x, so the
// constants are reflect64(x^(D+63) mod P) and reflect64(x^(D-1) mod P). Sixteen lanes fold side
// by side, 256 bytes a step (D = 2048 bits); at the end they fold into one 128-bit block with the
// message's remainder, and the crc32 instruction over its 16 bytes, from a zero register,
// finishes the reduction. The crc carried in (~crc) is XORed into the first four bytes, which
// is what starting the register at it means.
#define ACTOFF_AVX512 __attribute__((target("avx512f,avx512vl,vpclmulqdq,pclmul,sse4.2")))

ACTOFF_AVX512 inline __m512i fold(__m512i block, __m512i constants, __m512i into) {
  return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(block, constants, 0x00),
                                   _mm512_clmulepi64_epi128(block, constants, 0x11), into,
                                   0x96);  // a ^ b ^ c
}

ACTOFF_AVX512 inline __m128i fold_one(__m128i block, __m128i constants, __m128i into) {
  return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(block, constants, 0x00),
                                     _mm_clmulepi64_si128(block, constants, 0x11)),
                       into);
}

ACTOFF_AVX512 inline __m128i constants(const std::uint64_t* words) {
  return _mm_load_si128(reinterpret_cast<const __m128i*>(words));
}

ACTOFF_AVX512 std::uint32_t crc32c_avx512(std::uint32_t crc, const unsigned char* next,
                                          std::size_t nbytes) {
  if (nbytes < 512) return crc32c_sse42(crc, next, nbytes);
  const __m512i by2048 = _mm512_broadcast_i32x4(constants(kTables.fold2048));
  const __m512i by512 = _mm512_broadcast_i32x4(constants(kTables.fold512));
  const __m128i by128 = constants(kTables.fold128);
  const __m512i carried = _mm512_zextsi128_si512(_mm_cvtsi32_si128(static_cast<int>(~crc)));
  __m512i z0 = _mm512_xor_si512(_mm512_loadu_si512(next), carried);
  __m512i z1 = _mm512_loadu_si512(next + 64);
  __m512i z2 = _mm512_loadu_si512(next + 128);
  __m512i z3 = _mm512_loadu_si512(next + 192);
  for (next += 256, nbytes -= 256; nbytes >= 256; next += 256, nbytes -= 256) {
    z0 = fold(z0, by2048, _mm512_loadu_si512(next));
    z1 = fold(z1, by2048, _mm512_loadu_si512(next + 64));
    z2 = fold(z2, by2048, _mm512_loadu_si512(next + 128));
    z3 = fold(z3, by2048, _mm512_loadu_si512(next + 192));
  }
  z3 = fold(fold(fold(z0, by512, z1), by512, z2), by512, z3);
  for (; nbytes >= 64; next += 64, nbytes -= 64) z3 = fold(z3, by512, _mm512_loadu_si512(next));
  __m128i x = _mm512_extracti32x4_epi32(z3, 0);
  x = fold_one(x, by128, _mm512_extracti32x4_epi32(z3, 1));
  x = fold_one(x, by128, _mm512_extracti32x4_epi32(z3, 2));
  x = fold_one(x, by128, _mm512_extracti32x4_epi32(z3, 3));
  for (; nbytes >= 16; next += 16, nbytes -= 16)
    x = fold_one(x, by128, _mm_loadu_si128(reinterpret_cast<const __m128i*>(next)));
  std::uint64_t register_ = _mm_crc32_u64(0, static_cast<std::uint64_t>(_mm_cvtsi128_si64(x)));
  register_ = _mm_crc32_u64(register_, static_cast<std::uint64_t>(_mm_extract_epi64(x, 1)));
  for (; nbytes >= 8; nbytes -= 8, next += 8) register_ = _mm_crc32_u64(register_, load64(next));
  while (nbytes--) register_ = _mm_crc32_u8(static_cast<std::uint32_t>(register_), *next++);
  return ~static_cast<std::uint32_t>(register_);
}
#endif

}  // namespace

std::uint32_t crc32c(std::uint32_t crc, const void* data, std::size_t nbytes) {
  const auto* bytes = static_cast<const unsigned char*>(data);
#ifdef ACTOFF_CRC32C_X86
  if (kTables.avx512) return crc32c_avx512(crc, bytes, nbytes);
  if (kTables.hardware) return crc32c_sse42(crc, bytes, nbytes);
#endif
  return crc32c_portable(crc, bytes, nbytes);
}

std::vector<std::string> crc32c_methods() {
  std::vector<std::string> methods;
  if (kTables.avx512) methods.emplace_back("avx512");
  if (kTables.hardware) methods.emplace_back("sse4.2");
  methods.emplace_back("portable");
  return methods;
}

std::uint32_t crc32c_by(const std::string& method, std::uint32_t crc, const void* data,
                        std::size_t nbytes) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  if (method == "portable") return crc32c_portable(crc, bytes, nbytes);
#ifdef ACTOFF_CRC32C_X86
  if (method == "sse4.2" && kTables.hardware) return crc32c_sse42(crc, bytes, nbytes);
  if (method == "avx512" && kTables.avx512) return crc32c_avx512(crc, bytes, nbytes);
#endif
  std::string known;
  for (const auto& name : crc32c_methods()) known += (known.empty() ? "" : ", ") + name;
  throw std::invalid_argument("crc32c has no method '" + method + "' on this CPU (it has: " +
                              known + ")");
}

std::uint32_t seal_start(std::uint64_t sequence, std::uint64_t nbytes) {
  unsigned char header[16];
  for (int k = 0; k < 8; ++k) {
    header[k] = static_cast<unsigned char>(sequence >> (8 * k));
    header[8 + k] = static_cast<unsigned char>(nbytes >> (8 * k));
  }
  return crc32c_portable(0, header, sizeof(header));
}

}  // namespace actoff
