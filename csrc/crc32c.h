// CRC32C (Castagnoli) of byte ranges: what the I/O engine seals every record with.
//
// Contract
// - What: crc32c(crc, data, n) continues `crc` (0 to start) over n bytes, with the usual
//   pre- and post-inversion, so crc32c(crc32c(0, a), b) == crc32c(0, a followed by b) and
//   crc32c(0, "123456789", 9) == 0xE3069283. The SSE4.2 instruction where the CPU has it
//   (three interleaved streams, about 20 GB/s on one core), else slicing-by-8 tables.
// - Thread-safety: pure; the tables are built once, before main (static initialisation).
// - Errors: none.
#pragma once

#include <cstddef>
#include <cstdint>

namespace actoff {

std::uint32_t crc32c(std::uint32_t crc, const void* data, std::size_t nbytes);

// Whether crc32c runs on the CPU's instruction (false: the portable tables).
bool crc32c_hardware();

// The seal of one record: crc32c of (sequence, nbytes) as two little-endian 64-bit words,
// continued over the record's bytes. Bytes of another record (another sequence number) or of
// another length never match, even where the bytes themselves are equal.
std::uint32_t seal_start(std::uint64_t sequence, std::uint64_t nbytes);

}  // namespace actoff
