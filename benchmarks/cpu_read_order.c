/* Reads a paged cache's lines in the orders that decide how fast memory serves them.
 *
 * `read_lines` reads each 64-byte line of `blocks` blocks of `block_bytes` once,
 * block order[i] i-th (blocks lie anywhere, as a long-running engine leaves them),
 * and returns the sum of each line's first eight bytes (so no read can be left out).
 * Within a block it reads in address order (by_head == 0) or as the decode
 * attention kernel does with the cache's [slot][kv_head][dim] layout (by_head != 0):
 * head by head, each slot's `head_bytes` of that head, slots `slot_bytes` apart.
 * With ahead > 0 it also prefetches (into L2) one line for each line it reads, the
 * line `ahead` lines on in the blocks' address order. Built by cpu_read_order.py.
 */
#include <stddef.h>
#include <stdint.h>

#define LINE 64

/* Where the prefetches have got to: line `line` of block order[block]. */
struct cursor {
  int64_t block, line;
};

static inline void prefetch_next(const uint8_t* base, const int64_t* order, int64_t blocks, int64_t block_bytes,
                                 int64_t lines, struct cursor* at) {
  if (at->block >= blocks) return;
  __builtin_prefetch(base + order[at->block] * block_bytes + at->line * LINE, 0, 1);
  if (++at->line == lines) {
    at->line = 0;
    ++at->block;
  }
}

static inline uint64_t first_word(const uint8_t* line) {
  uint64_t word;
  __builtin_memcpy(&word, line, sizeof(word));
  return word;
}

uint64_t read_lines(const uint8_t* base, const int64_t* order, int64_t blocks, int64_t block_bytes,
                    int64_t slot_bytes, int64_t head_bytes, int64_t by_head, int64_t ahead) {
  const int64_t lines = block_bytes / LINE;
  struct cursor at = {blocks, 0};
  if (ahead > 0) {
    at.block = ahead / lines;
    at.line = ahead % lines;
  }
  uint64_t sum = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = base + order[b] * block_bytes;
    if (!by_head) {
      for (int64_t offset = 0; offset < block_bytes; offset += LINE) {
        prefetch_next(base, order, blocks, block_bytes, lines, &at);
        sum += first_word(block + offset);
      }
      continue;
    }
    for (int64_t head = 0; head < slot_bytes; head += head_bytes) {
      for (int64_t slot = head; slot < block_bytes; slot += slot_bytes) {
        for (int64_t offset = slot; offset < slot + head_bytes; offset += LINE) {
          prefetch_next(base, order, blocks, block_bytes, lines, &at);
          sum += first_word(block + offset);
        }
      }
    }
  }
  return sum;
}
