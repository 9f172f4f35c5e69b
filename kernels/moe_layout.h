// The grouped-GEMM layout of a latent-MoE dispatch: from the experts of every slot, the stable sort
// by expert, each expert's padded segment, where every sorted row goes, and where every slot's result
// comes back from. On CUDA one kernel (sort included up to kMoeLayoutSortRows slots) replaces the
// sort and ~20 small ATen ops and never syncs with the host; the ATen reference runs anywhere.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace kiln::kernels {

struct MoeLayout {
  at::Tensor counts;     // [E] int64: slots routed to each expert
  at::Tensor offsets;    // [E] int32: end row of each expert's padded segment; the last is `bound`
                         // (the grouped GEMM's offs)
  at::Tensor ends;       // [E] int32: the same, but the last segment ends where its rows do (rounded
                         // up to `align`): rows past it belong to no expert and need no compute
  at::Tensor segments;   // [E + 1] int64: 0, then `ends` (the W4A16 grouped kernel's offsets)
  at::Tensor order;      // [n] int64: the slot at each sorted position (a stable sort by expert)
  at::Tensor dest;       // [n] int64: padded row of each sorted slot
  at::Tensor src_token;  // [n] int64: the token each sorted slot reads (order / top_k)
  at::Tensor slot_row;   // [n] int64: padded row holding each slot's result, in slot order
  int64_t bound = 0;     // padded rows: n + E * (align - 1), a static bound (no host sync)
};

// ids [n] int64: the expert of every slot in slot order (the flat top-k ids, token-major); n a
// multiple of top_k. Each segment starts on an `align`-row boundary. Integer work only: the CUDA
// result equals the reference exactly.
MoeLayout moe_layout(const at::Tensor& ids, int64_t num_experts, int64_t top_k, int64_t align);
MoeLayout moe_layout_reference(const at::Tensor& ids, int64_t num_experts, int64_t top_k, int64_t align);
MoeLayout moe_layout_cuda(const at::Tensor& ids, int64_t num_experts, int64_t top_k, int64_t align);

}  // namespace kiln::kernels
