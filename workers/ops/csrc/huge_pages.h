// Transparent huge pages for a weight the kernels stream whole at every decode step: on 4 KiB pages a
// stream of hundreds of MB walks the page tables every 4 KiB and the hardware prefetcher restarts at
// each page. Linux's common default ("madvise" mode) grants 2 MiB pages only to memory that asks before
// it is first touched; elsewhere the advice is refused or ignored, and the pages stay as they were.
#pragma once

#include <sys/mman.h>

#include <cstddef>
#include <cstdint>

namespace raylm {

inline void advise_huge_pages(void* data, size_t bytes) {
#ifdef MADV_HUGEPAGE
  constexpr uintptr_t HUGE = uintptr_t{2} << 20;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + HUGE - 1) / HUGE * HUGE;
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) / HUGE * HUGE;
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#endif
}

}  // namespace raylm
