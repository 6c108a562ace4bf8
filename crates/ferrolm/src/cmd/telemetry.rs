//! What `run --expert-stats` and `bench` report about memory and the expert cache.

use ferrolm_engine::ExpertTierStats;
use ferrolm_model::ExpertCacheStats;

/// The process's peak resident set in bytes (`VmHWM` of `/proc/self/status`): mapped file
/// pages the process touched count, pages read with pread into the page cache do not.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// One line about a streamed-expert cache: its size, hits, misses, hit rate, bytes read.
pub fn expert_cache_line(st: &ExpertCacheStats) -> String {
    let mb = |b: u64| b as f64 / (1u64 << 20) as f64;
    format!(
        "ferrolm: expert cache ({:.1} MB, {} slots): {} hits, {} misses, hit rate {:.1}%, {:.1} MB read from the file",
        mb(st.cache_bytes as u64),
        st.slots,
        st.hits,
        st.misses,
        100.0 * st.hit_rate(),
        mb(st.bytes_read),
    )
}

/// The cache's counters as a JSON object.
pub fn expert_cache_json(st: &ExpertCacheStats) -> serde_json::Value {
    serde_json::json!({
        "cache_bytes": st.cache_bytes,
        "slots": st.slots,
        "slot_bytes": st.slot_bytes,
        "expert_bytes": st.expert_bytes,
        "hits": st.hits,
        "misses": st.misses,
        "hit_rate": st.hit_rate(),
        "bytes_read": st.bytes_read,
    })
}

/// One line about the experts' memory tiers under a GPU memory budget: how much each holds,
/// the share of selections served from device memory, the host rows they read.
pub fn expert_tier_line(st: &ExpertTierStats) -> String {
    let mb = |b: u64| b as f64 / (1u64 << 20) as f64;
    format!(
        "ferrolm: expert tiers ({:.1} MB in device memory, {:.1} MB in host memory): {} selections from the device, {} from host memory ({} of them computed on the CPU; {:.1}% on the device), {:.1} MB of host rows read",
        mb(st.device_expert_bytes),
        mb(st.host_expert_bytes),
        st.device_selections,
        st.host_selections,
        st.cpu_selections,
        100.0 * st.device_share(),
        mb(st.host_bytes),
    )
}

/// The tiers' counters as a JSON object.
pub fn expert_tier_json(st: &ExpertTierStats) -> serde_json::Value {
    serde_json::json!({
        "device_expert_bytes": st.device_expert_bytes,
        "host_expert_bytes": st.host_expert_bytes,
        "device_selections": st.device_selections,
        "host_selections": st.host_selections,
        "cpu_selections": st.cpu_selections,
        "device_share": st.device_share(),
        "host_bytes": st.host_bytes,
    })
}
