// CRC32C (Castagnoli) of byte ranges: what the I/O engine seals every record with.
//
// Contract
// - What: crc32c(crc, data, n) continues `crc` (0 to start) over n bytes, with the usual
//   pre- and post-inversion, so crc32c(crc32c(0, a), b) == crc32c(0, a followed by b) and
//   crc32c(0, "123456789", 9) == 0xE3069283. The fastest method the CPU has: carry-less
//   multiplication over AVX-512 (about 60 GB/s on one core from cache, memory-bound beyond),
//   the SSE4.2 crc32 instruction in three streams (about 30 GB/s from cache), or
//   slicing-by-8 tables. crc32c_by runs one method by name, for tests and benchmarks.
// - Errors: crc32c_by throws std::invalid_argument for a method this CPU lacks.
// - Thread-safety: pure; the tables are built once, before main (static initialisation).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace actoff {

std::uint32_t crc32c(std::uint32_t crc, const void* data, std::size_t nbytes);

// The methods this CPU can run, fastest first ("avx512", "sse4.2", "portable"); crc32c uses
// the first.
std::vector<std::string> crc32c_methods();

std::uint32_t crc32c_by(const std::string& method, std::uint32_t crc, const void* data,
                        std::size_t nbytes);

// The seal of one record: crc32c of (sequence, nbytes) as two little-endian 64-bit words,
// continued over the record's bytes. Bytes of another record (another sequence number) or of
// another length never match, even where the bytes themselves are equal.
std::uint32_t seal_start(std::uint64_t sequence, std::uint64_t nbytes);

}  // namespace actoff
