//! Routing keys several mixture-of-experts architectures share: the gating function, the
//! weights' renormalization and scale, grouped top-k, each read and checked here.

use super::Keys;
use crate::error::{ModelError, Result};
use crate::plan::{ExpertGroups, Gating};

/// `expert_gating_func`: an architecture that reads it (llama.cpp has no default for those:
/// an absent key aborts its graph) must find a value we run; the error names the value.
pub(crate) fn gating(k: &Keys<'_>) -> Result<Gating> {
    let key = k.key("expert_gating_func");
    match k.file.metadata().opt_u64(&key)? {
        None => Err(ModelError::Invalid(format!(
            "{key} is missing (1 softmax, 2 sigmoid, 3 softmax after top-k)"
        ))),
        Some(v) => Gating::from_gguf(v).ok_or_else(|| ModelError::Unsupported {
            what: "expert gating function (expert_gating_func)",
            value: format!(
                "{v} in {key} (ferrolm runs 1 softmax, 2 sigmoid, 3 softmax after top-k)"
            ),
        }),
    }
}

/// `expert_weights_scale`: `None` when absent, 0 or 1 (llama.cpp skips the multiply then).
pub(crate) fn weights_scale(k: &Keys<'_>) -> Result<Option<f32>> {
    Ok(k.opt_f32("expert_weights_scale")?
        .filter(|&s| s != 0.0 && s != 1.0))
}

/// `expert_weights_norm`, false when absent.
pub(crate) fn weights_norm(k: &Keys<'_>) -> Result<bool> {
    Ok(k.file
        .metadata()
        .opt_bool(&k.key("expert_weights_norm"))?
        .unwrap_or(false))
}

/// Grouped top-k (`expert_group_count`, `expert_group_used_count`), which llama.cpp applies to
/// any architecture whose file has more than one group; checked as llama.cpp asserts, and so
/// that the kept groups hold at least the `n_expert_used` experts a token needs.
pub(crate) fn groups(
    k: &Keys<'_>,
    n_expert: usize,
    n_expert_used: usize,
) -> Result<Option<ExpertGroups>> {
    let n_group = k.opt_usize("expert_group_count")?.unwrap_or(0);
    if n_group <= 1 {
        return Ok(None);
    }
    let n_group_used = k.opt_usize("expert_group_used_count")?.unwrap_or(0);
    let bad = |why: &str| {
        Err(ModelError::Invalid(format!(
            "{}: {n_group} expert groups (expert_group_count), {n_group_used} used \
             (expert_group_used_count), {n_expert} experts, {n_expert_used} used: {why}",
            k.arch
        )))
    };
    if n_group >= n_expert || !n_expert.is_multiple_of(n_group) {
        return bad("the groups must split the experts evenly");
    }
    if n_group_used == 0 || n_group_used >= n_group {
        return bad("the groups used must be at least 1 and fewer than the groups");
    }
    if n_group_used * (n_expert / n_group) < n_expert_used {
        return bad("the groups used hold fewer experts than a token uses");
    }
    Ok(Some(ExpertGroups {
        n_group,
        n_group_used,
    }))
}

/// `expert_count` and `expert_used_count`, both required and consistent.
pub(crate) fn counts(k: &Keys<'_>) -> Result<(usize, usize)> {
    let n_expert = k.opt_usize("expert_count")?.unwrap_or(0);
    let n_expert_used = k.opt_usize("expert_used_count")?.unwrap_or(0);
    if n_expert == 0 || n_expert_used == 0 || n_expert_used > n_expert {
        return Err(ModelError::Invalid(format!(
            "{}: {n_expert_used} experts used (expert_used_count) of {n_expert} (expert_count)",
            k.arch
        )));
    }
    Ok((n_expert, n_expert_used))
}
