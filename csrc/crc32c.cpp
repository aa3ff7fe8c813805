// CRC32C; the contract is in crc32c.h. The hardware path follows Mark Adler's crc32c.c
// (zlib licence): three streams of kLong (then kShort) bytes run through the crc32
// instruction side by side, which hides its three-cycle latency, and are joined by
// multiplying the earlier streams' crcs by x^(8 * length) with precomputed tables.
#include "crc32c.h"

#include <cstring>
#include <initializer_list>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <nmmintrin.h>
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
  bool hardware = false;

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
#ifdef ACTOFF_CRC32C_X86
    __builtin_cpu_init();  // this runs among the static constructors, maybe before libgcc's
    hardware = __builtin_cpu_supports("sse4.2");
#endif
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
#endif

}  // namespace

std::uint32_t crc32c(std::uint32_t crc, const void* data, std::size_t nbytes) {
  const auto* bytes = static_cast<const unsigned char*>(data);
#ifdef ACTOFF_CRC32C_X86
  if (kTables.hardware) return crc32c_sse42(crc, bytes, nbytes);
#endif
  return crc32c_portable(crc, bytes, nbytes);
}

bool crc32c_hardware() { return kTables.hardware; }

std::uint32_t seal_start(std::uint64_t sequence, std::uint64_t nbytes) {
  unsigned char header[16];
  for (int k = 0; k < 8; ++k) {
    header[k] = static_cast<unsigned char>(sequence >> (8 * k));
    header[8 + k] = static_cast<unsigned char>(nbytes >> (8 * k));
  }
  return crc32c_portable(0, header, sizeof(header));
}

}  // namespace actoff
