// The grouped-GEMM layout of a latent-MoE dispatch: from expert-sorted slots, each expert's padded
// segment, where every sorted row goes, and where every slot's result comes back from. One CUDA
// kernel replaces ~20 small ATen ops (and never syncs with the host); the ATen reference runs anywhere.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace kiln::kernels {

struct MoeLayout {
  at::Tensor counts;     // [E] int64: slots routed to each expert
  at::Tensor offsets;    // [E] int32: end row of each expert's padded segment; the last is `bound`
                         // (the grouped GEMM's offs)
  at::Tensor dest;       // [n] int64: padded row of each sorted slot
  at::Tensor src_token;  // [n] int64: the token each sorted slot reads (order / top_k)
  at::Tensor slot_row;   // [n] int64: padded row holding each slot's result, in slot order
  int64_t bound = 0;     // padded rows: n + E * (align - 1), a static bound (no host sync)
};

// sorted_experts [n] int64: the expert of each slot, ascending (a stable sort of the flat top-k
// ids); order [n] int64: the slot each sorted position came from. Each segment starts on an
// `align`-row boundary.
MoeLayout moe_layout(const at::Tensor& sorted_experts, const at::Tensor& order, int64_t num_experts, int64_t top_k,
                     int64_t align);
MoeLayout moe_layout_reference(const at::Tensor& sorted_experts, const at::Tensor& order, int64_t num_experts,
                               int64_t top_k, int64_t align);
MoeLayout moe_layout_cuda(const at::Tensor& sorted_experts, const at::Tensor& order, int64_t num_experts,
                          int64_t top_k, int64_t align);

}  // namespace kiln::kernels
