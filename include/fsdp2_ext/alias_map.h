// Which FQNs name one tensor object (tied `embed_tokens.weight` / `lm_head.weight`), computed from
// tensor identity before meta conversion so the aliases can be restored exactly afterwards.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

namespace fsdp2_ext {

// [Note: alias restoration order]
// Aliases are recorded from `named_parameters(remove_duplicate=False)` (and the same for buffers)
// *before* anything replaces a tensor, because every later step can split them: plain
// `to_empty` / `load_state_dict(assign=True)` give each name its own object. They are restored at
// the meta conversion (one new meta tensor per group, bound to every name of the group) so
// `fully_shard` sees one parameter and keeps the group in one FSDPParam. After sharding, shard
// fill swaps tensor contents in place (`torch.utils.swap_tensors`), which preserves identity, so
// no second rebinding is needed; the final check verifies every group is still one object.

// Groups `names[i] -> tensors[i]` by tensor identity (TensorImpl), in order of first appearance.
// Every distinct tensor yields one group; names[0] of a group is its canonical FQN.
std::vector<std::vector<std::string>> group_by_identity(
    const std::vector<std::string>& names, const std::vector<at::Tensor>& tensors);

}  // namespace fsdp2_ext
